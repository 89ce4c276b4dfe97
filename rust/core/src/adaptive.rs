//! SPEC §17 "Adaptive concurrency": one instance's concurrency limit found from its latency
//! gradient, as Envoy's adaptive concurrency filter does (`gradient_controller.cc`), adapted to
//! an LLM backend.
//!
//! - **Signal**: time per output token (TPOT), not request latency — an LLM request's latency
//!   is TTFT + n·TPOT, so a long answer would look like congestion. Under continuous batching
//!   every running sequence lengthens every other's TPOT: that rise is the knee to find.
//! - **sampleRTT**: the median TPOT of a window (at least 1 s and `MIN_SAMPLES` completions).
//! - **minRTT** without pinning: Envoy pins the limit to 3 for 50 requests every interval to
//!   measure it — minutes of lost capacity with multi-second requests. Here the base is the
//!   lowest window median seen, refreshed whenever a window ran at 2 or fewer in flight (then
//!   the median *is* the uncongested TPOT, so a backend that became slower is followed). The
//!   limit starts low (`INITIAL`), so the first window measures the base near idle.
//! - **New limit**: `g = clamp(base · (1 + BUFFER) / sampleRTT, 0.5, 2)`, `L ← L·g + √(L·g)`
//!   while `g ≥ 1` (probe upwards) and `L ← L·g` while congested (Envoy adds `√L` always, which
//!   holds the limit near twice the knee: here it settles between the knee and `√L` above).
//! - **Guards** (Netflix Gradient2): no growth while the window never used half the limit
//!   (app-limited: no evidence the backend can take more); `max_concurrency` is the ceiling.

use crate::types::Millis;

/// Windows shorter than this are not judged.
pub const WINDOW_MS: Millis = 1000;
/// Completions a window needs before it is judged.
pub const MIN_SAMPLES: usize = 16;
/// How far TPOT may rise above the base before the limit shrinks: up to twice the uncongested
/// TPOT. Envoy's 25 % suits RPCs; under continuous batching TPOT rises with the batch even when
/// healthy (vLLM on an H100: 6.5 → 10.9 ms from 1 to 16 running), and on the engine mock (two
/// `h100-7b`, one 3x slower, `benches/slo_core.py`, 2x load) a 25 % buffer held the limits at
/// 12 / 7 of 16 and cost 47 % of batch throughput, 50 % still 34 %, 100 % 17 %. A backend past
/// a real knee (flat to 4 running, then slower in proportion) still settles at 2–3× its knee,
/// not at the demand.
pub const BUFFER: f64 = 1.0;
/// The limit a fresh adaptive instance starts at (at most its ceiling).
pub const INITIAL: f64 = 4.0;
const KEEP: usize = 64;

#[derive(Clone, Debug)]
pub struct Gradient {
    limit: f64,
    base: Option<f64>,
    window_start: Millis,
    samples: [f32; KEEP],
    count: usize,
    /// The most in flight during the window.
    peak: u32,
    /// When the judgement this limit came from was made (ours or another worker's).
    adopted_at: Option<Millis>,
}

impl Gradient {
    pub fn new(ceiling: u32, now: Millis) -> Self {
        Self {
            limit: INITIAL.min(f64::from(ceiling)).max(1.0),
            base: None,
            window_start: now,
            samples: [0.0; KEEP],
            count: 0,
            peak: 0,
            adopted_at: None,
        }
    }

    /// The current limit as a whole number of requests, within [1, ceiling].
    pub fn limit(&self, ceiling: u32) -> u32 {
        (self.limit as u32).clamp(1, ceiling.max(1))
    }

    pub fn base(&self) -> Option<f64> {
        self.base
    }

    /// A grant: `in_flight` now runs there (this one included).
    pub fn on_grant(&mut self, in_flight: u32) {
        self.peak = self.peak.max(in_flight);
    }

    /// A TPOT sample (ms) of a completed request.
    pub fn on_sample(&mut self, tpot_ms: f64) {
        if !(tpot_ms.is_finite() && tpot_ms > 0.0) {
            return;
        }
        // The most recent KEEP samples of the window.
        self.samples[self.count % KEEP] = tpot_ms as f32;
        self.count += 1;
    }

    /// The limit before rounding (what the workers share).
    pub fn raw(&self) -> f64 {
        self.limit
    }

    /// SPEC §12, §17: adopts the limit another worker judged at `at` — the instance has one
    /// cap across workers. A judgement not seen before starts this worker's window afresh
    /// (its samples were taken under the old limit).
    pub fn adopt(&mut self, limit: f64, at: Millis, now: Millis) {
        self.limit = limit.max(1.0);
        if self.adopted_at != Some(at) {
            self.adopted_at = Some(at);
            self.window_start = now;
            self.count = 0;
            self.peak = 0;
        }
    }

    /// Judges the window if it is complete; returns whether it was judged (the limit may or
    /// may not have changed).
    pub fn update(&mut self, ceiling: u32, now: Millis) -> bool {
        if now < self.window_start.saturating_add(WINDOW_MS) || self.count < MIN_SAMPLES {
            return false;
        }
        let n = self.count.min(KEEP);
        let window = &mut self.samples[..n];
        window.sort_unstable_by(f32::total_cmp);
        let median = f64::from(window[n / 2]);
        let base = match self.base {
            Some(b) if self.peak > 2 => b.min(median),
            _ => median,
        };
        self.base = Some(base);
        let g = (base * (1.0 + BUFFER) / median).clamp(0.5, 2.0);
        // App-limited (the window never used half the limit): no evidence for more.
        let app_limited = f64::from(self.peak) < self.limit / 2.0;
        let lg = self.limit * g;
        self.limit = if g < 1.0 {
            lg
        } else if app_limited {
            self.limit
        } else {
            lg + lg.sqrt()
        }
        .clamp(1.0, f64::from(ceiling));
        self.window_start = now;
        self.count = 0;
        self.peak = 0;
        self.adopted_at = Some(now);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A backend flat up to `knee` running, then slowing in proportion.
    fn tpot(knee: f64, running: f64) -> f64 {
        10.0 * (running / knee).max(1.0)
    }

    #[test]
    fn settles_near_the_knee_under_unbounded_demand() {
        let mut g = Gradient::new(64, 0);
        let mut now = 0;
        let mut limits = Vec::new();
        for _ in 0..60 {
            let l = g.limit(64);
            for _ in 0..MIN_SAMPLES {
                g.on_grant(l);
                g.on_sample(tpot(4.0, f64::from(l)));
            }
            now += WINDOW_MS;
            g.update(64, now);
            limits.push(g.limit(64));
        }
        let tail = &limits[30..];
        assert!(
            tail.iter().all(|&l| (4..=12).contains(&l)),
            "limits {limits:?}"
        );
    }

    #[test]
    fn grows_to_the_ceiling_on_a_backend_without_a_knee() {
        let mut g = Gradient::new(32, 0);
        let mut now = 0;
        for _ in 0..30 {
            let l = g.limit(32);
            for _ in 0..MIN_SAMPLES {
                g.on_grant(l);
                g.on_sample(10.0);
            }
            now += WINDOW_MS;
            g.update(32, now);
        }
        assert_eq!(g.limit(32), 32);
    }

    #[test]
    fn does_not_grow_while_app_limited() {
        let mut g = Gradient::new(64, 0);
        for w in 1..10 {
            for _ in 0..MIN_SAMPLES {
                g.on_grant(1);
                g.on_sample(10.0);
            }
            g.update(64, w * WINDOW_MS);
        }
        assert_eq!(g.limit(64), 4);
    }

    #[test]
    fn follows_a_backend_that_became_slower() {
        let mut g = Gradient::new(64, 0);
        let mut now = 0;
        for round in 0..80 {
            let slow = if round >= 20 { 3.0 } else { 1.0 };
            let l = g.limit(64);
            for _ in 0..MIN_SAMPLES {
                g.on_grant(l);
                g.on_sample(slow * tpot(4.0, f64::from(l)));
            }
            now += WINDOW_MS;
            g.update(64, now);
        }
        // 3x slower everywhere: the knee is where it was, and the limit comes back to it
        let l = g.limit(64);
        assert!((3..=12).contains(&l), "limit {l}");
    }
}
