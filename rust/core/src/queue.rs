//! One priority class's bounded queue, fair across tenants, earliest deadline first within a
//! tenant.
//!
//! Entries wait in per-tenant queues visited round-robin (one grant per tenant per turn: fair
//! queuing without weights), so one tenant's 1,000-request batch cannot stall another tenant's
//! batch behind it. A tenant with nothing left waiting leaves the ring and rejoins at the back,
//! as in textbook round-robin.
//!
//! SPEC §17 "Ordering": inside a tenant's queue entries are ordered by (deadline, arrival
//! sequence). The deadline is arrival + the request's TTFT objective, or without one arrival +
//! the class's `max_wait_ms` — so with no objectives anywhere this is the FIFO it always was.
//! Fairness between tenants comes first and deadline order second, as llm-d's flow control
//! layers them (fairness policy between flows, ordering policy within a flow): a tenant that
//! sends only tight objectives must not take the whole class from one that sends none — its
//! deadlines order *its own* requests. With one tenant it is plain earliest deadline first.
//!
//! An entry whose objective can no longer be met (a hopeless head: its deadline, less the
//! fastest predicted TTFT, has passed) is re-keyed to arrival + `max_wait_ms`, i.e. back to
//! FIFO among the requests without objectives: EDF under overload otherwise serves the
//! already-late first and makes every later request late too (the "domino effect").
//!
//! Cancellation is O(tenants): the pool forgets the ticket and calls `forget`; the entry stays
//! as a tombstone until it reaches a head, where it is dropped. Capacity and depth count live
//! entries only (SPEC §3: a cancelled request "no longer counts toward capacity, depth or
//! metrics").
//!
//! Queue timeouts are not stored: an entry expires at its `enqueued_at` plus the class's current
//! `max_wait_ms`, so a reload that changes the bound applies to everyone already waiting. While
//! every entry went in at the back of its tenant's queue (its key after every other key there;
//! fresh arrivals with one objective per class always do) arrival order and key order agree
//! and heads are the oldest; an entry inserted in the middle (a retry, an earlier deadline, a
//! re-keyed head) or with exclusions makes the queue *irregular* and scans cover it whole.
//!
//! Why not a lock-free MPMC ring (crossbeam's `ArrayQueue`): every operation on a pool runs on
//! its owner's thread (the event loop), so there is no contention to be free of, and a ring can
//! neither remove from the middle nor re-insert a retry at its place (SPEC §3 "Retries keep
//! their place"). This structure takes no lock at all.

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
    /// SPEC §17: the order key within its tenant — arrival + TTFT objective, or without one
    /// arrival + the class's `max_wait_ms` (`Entry::new` sets `enqueued_at`).
    pub deadline: Millis,
    /// Whether `deadline` comes from an objective (not from `max_wait_ms`).
    pub objective: bool,
    /// The request's prompt tokens (a feature of the latency model).
    pub prompt_tokens: u32,
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
            deadline: enqueued_at,
            objective: false,
            prompt_tokens: 0,
            reinserted: false,
        }
    }

    /// Its order key (SPEC §17) and whether that came from an objective.
    pub fn with_deadline(mut self, deadline: Millis, objective: bool) -> Self {
        self.deadline = deadline;
        self.objective = objective;
        self
    }

    pub fn with_prompt_tokens(mut self, tokens: u32) -> Self {
        self.prompt_tokens = tokens;
        self
    }

    #[inline]
    fn key(&self) -> (Millis, Ticket) {
        (self.deadline, self.ticket)
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

/// Counts of present entries (live or tombstoned) that make scans cover whole queues.
#[derive(Clone, Copy, Debug, Default)]
struct Tally {
    /// Irregular entries (see `Entry::irregular`).
    irregular: usize,
    /// Entries with exclusions (the only ones §6's eviction can remove while something is up).
    restricted: usize,
}

impl Tally {
    fn add(&mut self, e: &Entry) {
        self.irregular += usize::from(e.irregular());
        self.restricted += usize::from(e.excluded != 0);
    }

    fn sub(&mut self, e: &Entry) {
        self.irregular -= usize::from(e.irregular());
        self.restricted -= usize::from(e.excluded != 0);
    }
}

#[derive(Debug)]
pub struct ClassQueue {
    /// Tenants with at least one live entry, in round-robin order.
    ring: VecDeque<TenantQueue>,
    live: usize,
    tally: Tally,
    /// At most the `enqueued_at` of every live entry (`Millis::MAX` when none has been
    /// pushed since the queue was empty); the exact minimum while `oldest_exact`. Expiry and
    /// the starvation guard read it instead of scanning a queue in deadline order.
    oldest: Millis,
    oldest_exact: bool,
    pub capacity: usize,
}

impl ClassQueue {
    pub fn new(capacity: usize) -> Self {
        Self {
            ring: VecDeque::new(),
            live: 0,
            tally: Tally::default(),
            oldest: Millis::MAX,
            oldest_exact: true,
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
        self.tally.irregular > 0
    }

    /// Whether some present entry has exclusions.
    #[inline]
    pub fn has_restricted(&self) -> bool {
        self.tally.restricted > 0
    }

    /// Adds an entry. Within a tenant entries stay in (deadline, ticket) order: a fresh arrival
    /// with the latest deadline goes last; a retry keeps its deadline and its ticket, so it
    /// goes back to its place (SPEC §3 "Retries keep their place").
    pub fn push(&mut self, entry: Entry) {
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
        if entry.enqueued_at < self.oldest {
            // a lower bound still; exact if it was (or the queue was empty: then `oldest` was
            // MAX and exact)
            self.oldest = entry.enqueued_at;
        }
        let placed = place(q, entry);
        self.tally.add(&placed);
    }

    /// SPEC §17: heads whose objective is lost — deadline before `horizon` (now + the fastest
    /// predicted TTFT) — are re-keyed to `enqueued_at + fifo_offset` (the class's
    /// `max_wait_ms`) and lose their objective, at most `limit` of them. Returns how many.
    pub fn rekey_hopeless(
        &mut self,
        is_live: &impl Fn(Ticket) -> bool,
        horizon: Millis,
        fifo_offset: Millis,
        limit: usize,
    ) -> usize {
        if self.live == 0 {
            return 0;
        }
        self.clean_heads(is_live);
        let mut done = 0;
        for q in self.ring.iter_mut() {
            while done < limit {
                let Some(head) = q.entries.front() else {
                    break;
                };
                if !(head.objective && head.deadline < horizon && is_live(head.ticket)) {
                    break;
                }
                let mut e = q.entries.pop_front().expect("a head");
                self.tally.sub(&e);
                e.reinserted = false;
                e.objective = false;
                e.deadline = e.enqueued_at.saturating_add(fifo_offset);
                let placed = place(q, e);
                self.tally.add(&placed);
                done += 1;
            }
        }
        done
    }

    /// SPEC §17 with `scheduler.shed_unattainable`: removes the entries whose objective is
    /// lost — deadline before `horizon` — instead of re-keying them (`rekey_hopeless`); returns
    /// their tickets. Costs a look at each tenant's head unless some head is before `horizon`.
    pub fn take_hopeless(
        &mut self,
        is_live: &impl Fn(Ticket) -> bool,
        horizon: Millis,
    ) -> Vec<Ticket> {
        if self.live == 0 {
            return Vec::new();
        }
        self.clean_heads(is_live);
        let due = self
            .ring
            .iter()
            .any(|q| q.entries.front().is_some_and(|h| h.deadline < horizon));
        if !due {
            return Vec::new();
        }
        self.remove_where(is_live, |e| e.objective && e.deadline < horizon)
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
        // The cancelled entry may have been the oldest.
        self.oldest_exact = false;
        if self.ring[i].live == 0 {
            let gone = self.ring.remove(i).expect("index from position");
            gone.entries.iter().for_each(|e| self.tally.sub(e));
        }
    }

    /// Drops tombstones at the heads.
    fn clean_heads(&mut self, is_live: &impl Fn(Ticket) -> bool) {
        for q in self.ring.iter_mut() {
            while let Some(e) = q.entries.front() {
                if is_live(e.ticket) {
                    break;
                }
                self.tally.sub(e);
                q.entries.pop_front();
            }
        }
    }

    /// Whose turn is next: the tenant at the front of the ring and the deadline (order key) of
    /// its first live entry (SPEC §12, §17: compared across workers).
    pub fn next_turn(&mut self, is_live: &impl Fn(Ticket) -> bool) -> Option<(Tenant, Millis)> {
        if self.live == 0 {
            return None;
        }
        self.clean_heads(is_live);
        self.ring
            .iter()
            .find(|q| q.live > 0)
            .and_then(|q| q.entries.front().map(|e| (q.tenant, e.deadline)))
    }

    /// The arrival time of the oldest live entry (the starvation guard's "oldest low").
    pub fn oldest_enqueued_at(&mut self, is_live: &impl Fn(Ticket) -> bool) -> Option<Millis> {
        if self.live == 0 {
            return None;
        }
        if self.oldest_exact {
            return Some(self.oldest);
        }
        let oldest = if self.tally.irregular > 0 {
            // An entry with an earlier deadline or a retry back at its place can hide an older
            // entry behind it.
            self.ring
                .iter()
                .flat_map(|q| q.entries.iter())
                .filter(|e| is_live(e.ticket))
                .map(|e| e.enqueued_at)
                .min()
        } else {
            self.clean_heads(is_live);
            self.ring
                .iter()
                .filter_map(|q| q.entries.front())
                .map(|e| e.enqueued_at)
                .min()
        };
        self.oldest = oldest.unwrap_or(Millis::MAX);
        self.oldest_exact = true;
        oldest
    }

    /// An entry left: if it was the oldest, the minimum must be found again.
    fn left(&mut self, e: &Entry) {
        self.tally.sub(e);
        if e.enqueued_at <= self.oldest {
            self.oldest_exact = false;
        }
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
                self.left(&entry);
                if served.live > 0 {
                    self.ring.push_back(served);
                } else {
                    served.entries.iter().for_each(|e| self.tally.sub(e));
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
        let mut dropped = Tally::default();
        let full_scan = self.tally.irregular > 0;
        for q in self.ring.iter_mut() {
            let mut removed_live = 0;
            if full_scan {
                q.entries.retain(|e| {
                    let live = is_live(e.ticket);
                    let remove = !live || pred(e);
                    if remove {
                        dropped.add(e);
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
                    dropped.add(e);
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
                q.entries.iter().for_each(|e| dropped.add(e));
            }
            q.live > 0
        });
        self.tally.irregular -= dropped.irregular;
        self.tally.restricted -= dropped.restricted;
        if !out.is_empty() {
            self.oldest_exact = false;
        }
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
        if self.live == 0 || self.oldest.saturating_add(max_wait) > now {
            // `oldest` is at most every live entry's arrival: none is due.
            return Vec::new();
        }
        let mut out = self.remove_where(is_live, |e| e.enqueued_at.saturating_add(max_wait) <= now);
        // The bound may have been stale (the oldest left): find the true oldest, so the next
        // wake-up is not in the past.
        self.oldest_exact = false;
        self.oldest_enqueued_at(is_live);
        // Answered in arrival order, whatever order deadlines kept them in.
        out.sort_unstable();
        out
    }

    /// A reload changed the class's `max_wait_ms` from `old` to `new`: entries without an
    /// objective are keyed by it (arrival + `max_wait_ms`), so their keys move with it and
    /// every tenant's queue is put back in (deadline, ticket) order.
    pub fn rekey_fifo(&mut self, old: Millis, new: Millis) {
        if old == new || self.ring.is_empty() {
            return;
        }
        for q in self.ring.iter_mut() {
            for e in q.entries.iter_mut().filter(|e| !e.objective) {
                e.deadline = e.deadline.saturating_sub(old).saturating_add(new);
            }
            q.entries.make_contiguous().sort_by_key(Entry::key);
        }
        // Which entries now break arrival order (see the module's doc on regularity).
        let mut tally = Tally::default();
        for q in self.ring.iter_mut() {
            let mut latest: Millis = 0;
            for e in q.entries.iter_mut() {
                e.reinserted = e.enqueued_at < latest;
                latest = latest.max(e.enqueued_at);
                tally.add(e);
            }
        }
        self.tally = tally;
    }

    /// When the earliest live entry times out (tombstones may make it early, never late).
    /// The earliest objective among the tenants' heads (SPEC §17: when shedding, the pool
    /// wakes when it is lost). Heads only: an objective behind a head without one has a later
    /// deadline than that head's key, and is looked at once it is a head.
    pub fn earliest_objective_head(&self) -> Option<Millis> {
        self.ring
            .iter()
            .filter_map(|q| q.entries.front())
            .filter(|e| e.objective)
            .map(|e| e.deadline)
            .min()
    }

    pub fn next_deadline(&self, max_wait: Millis) -> Option<Millis> {
        if self.live == 0 {
            return None;
        }
        let oldest = if self.oldest_exact {
            Some(self.oldest)
        } else if self.tally.irregular > 0 {
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
        self.tally = Tally::default();
        self.oldest = Millis::MAX;
        self.oldest_exact = true;
        out
    }
}

/// Inserts `entry` at its (deadline, ticket) place in its tenant's queue; returns it as placed
/// (marked reinserted when it went before another entry).
fn place(q: &mut TenantQueue, mut entry: Entry) -> Entry {
    if !entry.objective && q.entries.back().is_some_and(|l| l.ticket > entry.ticket) {
        // A retry without an objective: its arrival-based key was computed again from the
        // retry's time; it still goes before every later arrival without an objective.
        if let Some(m) = q
            .entries
            .iter()
            .filter(|e| !e.objective && e.ticket > entry.ticket)
            .map(|e| e.deadline)
            .min()
        {
            entry.deadline = entry.deadline.min(m);
        }
    }
    let at_back = q
        .entries
        .back()
        .is_none_or(|last| last.key() < entry.key() && last.enqueued_at <= entry.enqueued_at);
    if at_back {
        q.entries.push_back(entry);
    } else {
        entry.reinserted = true;
        let key = entry.key();
        let at = q.entries.partition_point(|e| e.key() < key);
        q.entries.insert(at, entry);
    }
    entry
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

    fn d(ticket: Ticket, deadline: Millis) -> Entry {
        Entry::new(ticket, 0, ticket, 0).with_deadline(deadline, true)
    }

    fn drain(q: &mut ClassQueue) -> Vec<Ticket> {
        std::iter::from_fn(|| q.pop_fitting(&|_| true, |_| Some(0)).map(|(e, _)| e.ticket))
            .collect()
    }

    #[test]
    fn earliest_deadline_first_within_a_tenant() {
        let mut q = ClassQueue::new(100);
        q.push(d(1, 500));
        q.push(d(2, 300));
        q.push(Entry::new(3, 0, 3, 0).with_deadline(400, false));
        q.push(d(4, 300));
        // equal deadlines go by arrival
        assert_eq!(drain(&mut q), vec![2, 4, 3, 1]);
        assert!(!q.has_irregular());
    }

    #[test]
    fn tenants_still_take_turns_under_deadlines() {
        let mut q = ClassQueue::new(100);
        q.push(d(1, 900));
        q.push(d(2, 950));
        q.push(Entry::new(3, 7, 3, 0).with_deadline(10, true));
        q.push(Entry::new(4, 7, 4, 0).with_deadline(20, true));
        // tenant 0 is first in the ring; tenant 7's tight deadlines order its own requests
        assert_eq!(drain(&mut q), vec![1, 3, 2, 4]);
    }

    #[test]
    fn a_retry_keeps_its_deadline_and_place() {
        let mut q = ClassQueue::new(100);
        q.push(d(1, 100));
        q.push(d(3, 300));
        q.push(d(2, 200)); // retried with its deadline
        assert_eq!(drain(&mut q), vec![1, 2, 3]);
        // without objectives: a retry re-keyed from its later time still goes before later arrivals
        q.push(Entry::new(5, 0, 50, 0).with_deadline(1050, false));
        q.push(Entry::new(6, 0, 60, 0).with_deadline(1060, false));
        q.push(Entry::new(4, 0, 70, 0).with_deadline(1070, false));
        assert_eq!(drain(&mut q), vec![4, 5, 6]);
    }

    #[test]
    fn hopeless_heads_go_back_to_fifo() {
        let mut q = ClassQueue::new(100);
        q.push(Entry::new(1, 0, 0, 0).with_deadline(100, true));
        q.push(Entry::new(2, 0, 10, 0).with_deadline(1010, false));
        q.push(Entry::new(3, 0, 20, 0).with_deadline(500, true));
        // at 150 entry 1's deadline has passed: it goes back to arrival + 1000
        assert_eq!(q.rekey_hopeless(&|_| true, 150, 1000, 8), 1);
        assert_eq!(q.next_turn(&|_| true), Some((0, 500)));
        assert_eq!(drain(&mut q), vec![3, 1, 2]);
        assert!(!q.has_irregular());
    }
}
