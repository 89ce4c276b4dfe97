//! SPEC §12: one pool's door to the workers' shared region (`shm.rs`). A `Pool` with a
//! `Shared` keeps its own queue (its requests are awaited in this process) but takes every
//! unit of an instance from the shared lease word, sees the other workers' in-flight counts
//! (least-connections and the cap see the whole gateway), their waiting requests (the class
//! selector, the starvation guard and "nothing is waiting" see the union), their ejections and
//! probe results, and commits its grants to the one shared selector state.
//!
//! Without a `Shared` nothing here runs: a single process pays one `Option` check per
//! operation.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use crate::health::HealthConfig;
use crate::instance::Instance;
use crate::selector::Selector;
use crate::shm::{PeerWaiting, Region, TENANT_OVERFLOW};
use crate::types::{InstanceState, Millis, Priority, Tenant};

/// A deferral is stale — the peer cannot use the unit (its head is cooling there, or excluded),
/// so this worker serves its own — once the peer has looked at the pool since and its turn is
/// unchanged, or after this long whatever it did (a peer that stopped is killed and reclaimed
/// by the supervisor; meanwhile no unit waits longer than this for it).
const STALE_DEFER_MS: Millis = 1000;

/// Tenant entries a worker with nothing waiting may keep joined (8 workers keep at most half
/// the table).
const KEEP_TENANTS: usize = 4;

/// `slots[i]` of an instance that holds no cell (removed, and left once idle).
const UNBOUND: usize = usize::MAX;

/// A turn given up to another worker: which, what it had waiting then, and when.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Deferral {
    class: Priority,
    worker: usize,
    /// Its turn (tenant entry, head deadline) and how many it had waiting in the class: a
    /// grant there changes the count even when the next request looks the same.
    turn: (usize, Millis, u64),
    /// How many times it had looked at the pool.
    looks: u64,
    at: Millis,
}

/// SPEC §12 "bounded and reclaimed", per process: which region cells this process's pools
/// use, counted. A cell's user bit is the worker's, not a pool's, and one worker may hold two
/// pools of one name — a removed pool still draining and its re-added successor — which share
/// the pool's slot and every instance cell and tenant entry both bind. So a pool leaves a cell
/// only through this count: the worker leaves it in the region when no pool of its process
/// uses it any more (then what the worker still holds there is that pool's alone), and leaves
/// the pool's slot with its last pool of that name (`Region::leave_pool`).
///
/// One per process and region (the binding keeps it beside its mapping); a pool attached
/// without one counts alone, as if it were its process's only pool of that name. Locked (never
/// contended: a worker schedules on one thread) only when a pool joins or leaves a cell — on a
/// request's path only when its tenant's entry is joined or left (`KEEP_TENANTS`), beside the
/// table scan or CAS that costs anyway.
#[derive(Clone, Debug, Default)]
pub struct Joins(Arc<Mutex<HashMap<(usize, usize), Uses>>>);

/// What one worker's pools of one pool slot use: (pools, instance cells, tenant entries).
#[derive(Debug, Default)]
struct Uses {
    pools: u32,
    cells: HashMap<(Table, usize), u32>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Table {
    Instance,
    Tenant,
}

impl Joins {
    fn with<T>(&self, key: (usize, usize), f: impl FnOnce(&mut Uses) -> T) -> T {
        // A panic elsewhere while locked leaves plain counts: still usable.
        let mut map = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let uses = map.entry(key).or_default();
        let out = f(uses);
        if uses.pools == 0 && uses.cells.is_empty() {
            map.remove(&key);
        }
        out
    }

    /// One more use of cell `k` of `table`.
    fn join(&self, key: (usize, usize), table: Table, k: usize) {
        self.with(key, |u| *u.cells.entry((table, k)).or_default() += 1);
    }

    /// One use fewer; whether it was the process's last.
    fn leave(&self, key: (usize, usize), table: Table, k: usize) -> bool {
        self.with(key, |u| match u.cells.get_mut(&(table, k)) {
            Some(n) if *n > 1 => {
                *n -= 1;
                false
            }
            Some(_) => {
                u.cells.remove(&(table, k));
                true
            }
            None => true,
        })
    }

    /// Pools of one name in this process, attached / detached; `leave_pool`: whether the last.
    fn join_pool(&self, key: (usize, usize)) {
        self.with(key, |u| u.pools += 1);
    }

    fn leave_pool(&self, key: (usize, usize)) -> bool {
        self.with(key, |u| {
            u.pools = u.pools.saturating_sub(1);
            u.pools == 0
        })
    }
}

#[derive(Debug)]
pub struct Shared {
    region: Region<'static>,
    pool: usize,
    worker: usize,
    /// `slots[i]`: the region's cell of the pool's instance `i` (`UNBOUND`: none any more).
    slots: Vec<usize>,
    /// The latest ejection generation and probe sequence applied, per instance.
    seen_ejection: Vec<u64>,
    seen_probe: Vec<u64>,
    /// The latest ejection end this worker published, per instance.
    published_until: Vec<Millis>,
    pub peers: PeerWaiting,
    /// Worker slots to wake (a unit is free for what they have waiting).
    wakes: u64,
    /// Tenant table entries this worker joined, cached (joining scans the table). Left, and
    /// emptied, whenever this worker has nothing waiting in the pool and holds more than
    /// `KEEP_TENANTS` (SPEC §16: bounded by the tenants waiting at once, not by every tenant
    /// ever seen).
    tenants: HashMap<Tenant, usize>,
    /// The latest turn given up to a peer.
    deferred: Option<Deferral>,
    /// This process's uses of the region's cells (see `Joins`).
    joins: Joins,
}

impl Shared {
    /// Worker `worker`'s share of pool `pool_id` (joined: see `Joins`). `None`: the worker slot
    /// is not the region's, or every pool slot is used by other pools.
    pub fn new(region: Region<'static>, joins: Joins, pool_id: u64, worker: usize) -> Option<Self> {
        if worker >= region.workers() {
            return None;
        }
        let pool = region.join_pool(pool_id, worker)?;
        joins.join_pool((pool, worker));
        Some(Self {
            joins,
            pool,
            region,
            worker,
            slots: Vec::new(),
            seen_ejection: Vec::new(),
            seen_probe: Vec::new(),
            published_until: Vec::new(),
            peers: PeerWaiting::default(),
            wakes: 0,
            tenants: HashMap::new(),
            deferred: None,
        })
    }

    pub fn worker(&self) -> usize {
        self.worker
    }

    /// Instance `idx` of the pool is the one with stable id `id` (reloads reuse indexes, never
    /// ids). `None`: the pool's slots are used up.
    pub fn bind(&mut self, idx: usize, id: u64) -> Option<()> {
        // A reused index: the instance it held is gone and idle here (the pool reuses only
        // those), so this worker leaves its cell first (SPEC §12 bounded and reclaimed).
        self.leave(idx);
        let slot = self.region.instance_slot(self.pool, id, self.worker)?;
        self.joins
            .join((self.pool, self.worker), Table::Instance, slot);
        if idx >= self.slots.len() {
            self.slots.resize(idx + 1, UNBOUND);
            self.seen_ejection.resize(idx + 1, 0);
            self.seen_probe.resize(idx + 1, 0);
            self.published_until.resize(idx + 1, 0);
        }
        self.slots[idx] = slot;
        // A fresh instance adopts what the others already know of it.
        self.seen_ejection[idx] = 0;
        self.seen_probe[idx] = self.region.probe(self.pool, slot).0;
        self.published_until[idx] = 0;
        Some(())
    }

    /// SPEC §12 "region cells of removed instances ... are reclaimed": this worker leaves
    /// instance `idx`'s cell (removed, nothing of ours runs there); the last worker to leave
    /// frees it.
    fn leave(&mut self, idx: usize) {
        let Some(s) = self.slot(idx) else {
            return;
        };
        self.slots[idx] = UNBOUND;
        // The same instance re-added by a reload while its old index drains shares the cell,
        // and so does another pool of this name in this process (`Joins`): this worker leaves
        // only when nothing of its process uses the cell any more.
        if self
            .joins
            .leave((self.pool, self.worker), Table::Instance, s)
        {
            self.region.leave_instance(self.pool, s, self.worker);
        }
    }

    /// SPEC §12 "bounded and reclaimed": the pool closed — it leaves what it joined (every
    /// instance cell and tenant entry no other pool of its process uses) and, the last of its
    /// name in the process, the pool's slot (`Region::leave_pool`: every unit the worker still
    /// holds there goes back; the last worker frees the slot for another pool).
    ///
    /// Explicit, not `Drop`: a pool dropped without it is a killed worker's — its cells stay
    /// until the supervisor reclaims its slot — so a process that loses a pool's handle (or a
    /// test that kills a worker by dropping its pool) never writes to the region after.
    pub fn detach(mut self) {
        for idx in 0..self.slots.len() {
            self.leave(idx);
        }
        for (_, k) in std::mem::take(&mut self.tenants) {
            self.leave_tenant(k);
        }
        if self.joins.leave_pool((self.pool, self.worker)) {
            self.region.leave_pool(self.pool, self.worker);
        }
    }

    /// This worker leaves tenant entry `k` (joined by `tenant_slot`), in the region once no
    /// pool of its process uses it.
    fn leave_tenant(&self, k: usize) {
        if k < TENANT_OVERFLOW && self.joins.leave((self.pool, self.worker), Table::Tenant, k) {
            self.region.leave_tenant(self.pool, k, self.worker);
        }
    }

    fn slot(&self, idx: usize) -> Option<usize> {
        self.slots.get(idx).copied().filter(|&s| s != UNBOUND)
    }

    /// Instances of this pool bound to a region cell.
    pub fn bound(&self) -> usize {
        self.slots.iter().filter(|&&s| s != UNBOUND).count()
    }

    /// Tenant entries this worker has joined (its cache's size).
    pub fn tenants_cached(&self) -> usize {
        self.tenants.len()
    }

    /// Reads what the other workers changed: their in-flight counts, ejections, probe results,
    /// waiting requests and the selector. Transitions it causes go to `transitions`.
    pub fn sync(
        &mut self,
        instances: &mut [Instance],
        health: &HealthConfig,
        selector: &mut Selector,
        transitions: &mut Vec<(usize, InstanceState)>,
        now: Millis,
    ) -> bool {
        let (r, p, me) = (self.region, self.pool, self.worker);
        let mut changed = false;
        for (k, inst) in instances.iter_mut().enumerate() {
            if inst.removed && inst.in_flight == 0 {
                self.leave(k);
            }
            let Some(s) = self.slot(k) else {
                inst.peer_in_flight = 0;
                continue;
            };
            let (held, mine) = r.held_split(p, s, me);
            inst.peer_in_flight = held.saturating_sub(mine).min(u64::from(u32::MAX)) as u32;
            // SPEC §17: an adaptive instance's cap is the limit the workers share.
            if let (_, Some((limit, _))) = r.limit(p, s) {
                inst.limit = (limit as u32).clamp(1, inst.max_concurrency);
            }
            let before = inst.state();
            let (gen, until) = r.ejection(p, s);
            if gen != self.seen_ejection[k] {
                self.seen_ejection[k] = gen;
                if until > now && !inst.removed {
                    inst.adopt_ejection(until);
                }
            }
            let (seq, ok) = r.probe(p, s);
            if seq != self.seen_probe[k] {
                self.seen_probe[k] = seq;
                inst.on_probe(health, ok, now);
            }
            let after = inst.state();
            if after != before {
                transitions.push((k, after));
                changed = true;
            }
        }
        self.peers = r.peers_waiting(p, me);
        selector.set_shared(r.selector(p));
        changed
    }

    /// SPEC §17: instance `idx`'s shared adaptive limit — the word read and (limit, when it
    /// was judged), if set.
    pub fn limit(&self, idx: usize) -> (u64, Option<(f64, Millis)>) {
        self.slot(idx)
            .map_or((0, None), |s| self.region.limit(self.pool, s))
    }

    /// Sets the shared limit if the word is still `seen`; whether it was.
    pub fn judge_limit(&self, idx: usize, seen: u64, limit: Option<(f64, Millis)>) -> bool {
        self.slot(idx)
            .is_some_and(|s| self.region.judge_limit(self.pool, s, seen, limit))
    }

    /// Clears instance `idx`'s shared limit (its cap is `max_concurrency` again).
    pub fn clear_limit(&self, idx: usize) {
        loop {
            let (seen, _) = self.limit(idx);
            if seen == 0 || self.judge_limit(idx, seen, None) {
                return;
            }
        }
    }

    /// A place in `class`'s queue, counted across workers against `capacity`.
    pub fn take_place(&mut self, class: Priority, capacity: usize) -> bool {
        self.region.take_place(
            self.pool,
            self.worker,
            class == Priority::High,
            capacity as u64,
        )
    }

    /// Takes a unit of instance `idx` (and, half-open, one of its global trial permits).
    pub fn take(&self, idx: usize, inst: &Instance, trial_permits: u32) -> bool {
        let Some(s) = self.slot(idx) else {
            return false;
        };
        let (r, p, me) = (self.region, self.pool, self.worker);
        if !r.take(p, s, me, u64::from(inst.limit)) {
            return false;
        }
        if inst.state() == InstanceState::HalfOpen
            && !r.take_trial(p, s, me, u64::from(trial_permits))
        {
            r.give(p, s, me);
            return false;
        }
        true
    }

    /// Gives back a unit of instance `idx` (and its trial permit, if it was a trial).
    pub fn give(&self, idx: usize, trial: bool) {
        let Some(s) = self.slot(idx) else {
            return;
        };
        let (r, p, me) = (self.region, self.pool, self.worker);
        r.give(p, s, me);
        if trial {
            r.give_trial(p, s, me);
        }
    }

    /// Commits a grant to the shared selector (the local `before`/`after` tell the change).
    pub fn commit(&self, before: &Selector, after: &Selector, class: Priority, now: Millis) {
        let (b, a) = (before.shared(), after.shared());
        let low = (class == Priority::Low).then_some(now);
        let keep = a.consecutive_high != 0;
        self.region.commit_selector(
            self.pool,
            a.credit_high - b.credit_high,
            |c| if keep { c.saturating_add(1) } else { 0 },
            low,
        );
        self.region.count_grant(self.pool, class == Priority::High);
    }

    /// Publishes this worker's waiting requests (counts and oldest arrival per class).
    pub fn publish_waiting(
        &mut self,
        counts: (usize, usize),
        oldest: (Option<Millis>, Option<Millis>),
    ) {
        self.region.looked(self.pool, self.worker);
        if counts == (0, 0) && self.tenants.len() > KEEP_TENANTS {
            // Nothing of ours waits: no tenant entry is ours to hold (SPEC §12 idle tenants
            // are reclaimed; the last worker to leave one frees it). A few are kept joined
            // (the common case, a handful of keys, then costs no table scan per request):
            // at most `KEEP_TENANTS` per worker, a fraction of the table.
            for (_, k) in std::mem::take(&mut self.tenants) {
                self.leave_tenant(k);
            }
        }
        // Places of entries that left (granted, cancelled, expired, evicted) go back.
        let (r, p, me) = (self.region, self.pool, self.worker);
        r.settle_places(p, me, true, counts.0 as u64);
        r.settle_places(p, me, false, counts.1 as u64);
        self.region.publish_waiting(
            self.pool,
            self.worker,
            counts.0 as u64,
            counts.1 as u64,
            oldest.0,
            oldest.1,
        );
    }

    /// Publishes the ejections this worker decided, for the others to adopt.
    pub fn publish_ejections(&mut self, instances: &[Instance]) {
        let (r, p) = (self.region, self.pool);
        for (k, inst) in instances.iter().enumerate() {
            let Some(s) = self.slot(k) else {
                continue;
            };
            if let Some(until) = inst.ejected_until() {
                if until > self.published_until[k] {
                    self.published_until[k] = until;
                    let (gen, _) = r.publish_ejection(p, s, until);
                    self.seen_ejection[k] = gen; // our own: not adopted again
                    r.reset_failures(p, s);
                }
            }
        }
    }

    /// An attempt's outcome on a healthy instance, counted across workers: the consecutive
    /// failures now (0 after a success).
    pub fn outcome(&self, idx: usize, failed: bool) -> u64 {
        let Some(s) = self.slot(idx) else {
            return 0;
        };
        if failed {
            self.region.count_failure(self.pool, s)
        } else {
            self.region.reset_failures(self.pool, s);
            0
        }
    }

    pub fn publish_probe(&mut self, idx: usize, ok: bool) {
        let Some(s) = self.slot(idx) else {
            return;
        };
        self.region.publish_probe(self.pool, s, ok);
        self.seen_probe[idx] = self.region.probe(self.pool, s).0;
    }

    pub fn claim_probe(&self, idx: usize, now: Millis, interval_ms: Millis) -> bool {
        self.slot(idx)
            .is_some_and(|s| self.region.claim_probe(self.pool, s, now, interval_ms))
    }

    fn tenant_slot(&mut self, tenant: Tenant) -> usize {
        let (r, p, me, joins) = (self.region, self.pool, self.worker, &self.joins);
        *self.tenants.entry(tenant).or_insert_with(|| {
            let k = r.tenant_slot(p, tenant, me).unwrap_or(TENANT_OVERFLOW);
            if k < TENANT_OVERFLOW {
                joins.join((p, me), Table::Tenant, k);
            }
            k
        })
    }

    /// A request of `tenant` starts waiting (fair share: an idle tenant joins at the pool's
    /// virtual time).
    pub fn tenant_waits(&mut self, tenant: Tenant) {
        let k = self.tenant_slot(tenant);
        self.region.tenant_waits(self.pool, k);
    }

    /// A grant to `tenant`, counted for fair share across workers.
    pub fn tenant_granted(&mut self, tenant: Tenant) {
        let k = self.tenant_slot(tenant);
        self.region.count_tenant_grant(self.pool, k);
    }

    /// This worker's next turn per class, for the others to compare with theirs.
    pub fn publish_turns(&mut self, high: Option<(Tenant, Millis)>, low: Option<(Tenant, Millis)>) {
        let high = high.map(|(t, at)| (self.tenant_slot(t), at));
        let low = low.map(|(t, at)| (self.tenant_slot(t), at));
        self.region.publish_turns(self.pool, self.worker, high, low);
    }

    /// SPEC §12 "tenant fair share ... apply to the union": the worker whose next turn in
    /// `class` deserves the unit more than ours — its tenant has had fewer grants across all
    /// workers, or as many and its head's deadline is earlier (SPEC §17: "deadlines are
    /// compared across workers"; without objectives that is the earlier arrival, as the
    /// deadline is then arrival + `max_wait_ms`) — or `None` if ours is the one.
    pub fn better_turn(
        &mut self,
        class: Priority,
        mine: (Tenant, Millis),
        now: Millis,
    ) -> Option<usize> {
        let (r, p) = (self.region, self.pool);
        let high = class == Priority::High;
        let mine_slot = self.tenant_slot(mine.0);
        let key = |(k, at): (usize, Millis)| (r.tenant_grants(p, k), at);
        let mut best = (key((mine_slot, mine.1)), None);
        let mask = if high {
            self.peers.high_workers
        } else {
            self.peers.low_workers
        };
        for w in (0..r.workers()).filter(|w| mask & (1 << w) != 0) {
            if let Some(turn) = r.turn(p, w, high) {
                if key(turn) < best.0 {
                    best = (key(turn), Some((w, turn)));
                }
            }
        }
        let (w, (slot, head)) = best.1?;
        let (high_n, low_n) = r.waiting_of(p, w);
        let turn = (slot, head, if high { high_n } else { low_n });
        let looks = r.looks(p, w);
        match self.deferred {
            Some(d) if (d.class, d.worker, d.turn) == (class, w, turn) => {
                if looks > d.looks || now >= d.at.saturating_add(STALE_DEFER_MS) {
                    // It looked since (and saw the free unit) yet the same turn waits: it
                    // cannot take it there. Serve our own.
                    return None;
                }
            }
            _ => {
                self.deferred = Some(Deferral {
                    class,
                    worker: w,
                    turn,
                    looks,
                    at: now,
                })
            }
        }
        self.wakes |= 1 << w;
        Some(w)
    }

    /// Someone else has `class` waiting: wake them (this worker has none of it).
    pub fn defer_to(&mut self, class: Priority) {
        self.wakes |= match class {
            Priority::High => self.peers.high_workers,
            Priority::Low => self.peers.low_workers,
        };
    }

    /// A unit is free that this worker's queue did not take: wake everyone waiting.
    pub fn offer(&mut self) {
        self.wakes |= self.peers.workers;
    }

    pub fn take_wakes(&mut self) -> u64 {
        std::mem::take(&mut self.wakes)
    }

    /// Grants by all workers (high, low).
    pub fn grants(&self) -> (u64, u64) {
        self.region.grants(self.pool)
    }

    pub fn reset_credit(&self) {
        self.region.reset_selector_credit(self.pool);
    }
}
