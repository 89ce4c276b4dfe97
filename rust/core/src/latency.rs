//! SPEC §17 "Prediction": an online model of one instance's time to first token (TTFT) and
//! time per output token (TPOT), learned from the requests it completes.
//!
//! **Model.** Exponentially weighted least squares (EWLS) on features the gateway knows
//! exactly at dispatch, with no scrape lag:
//! - TTFT = θ·[1, u, A, r, w, k] — `u` the request's prompt tokens, `A` prompt tokens of the
//!   instance's requests still awaiting their first token (the prefill queue ahead of it), `r`
//!   requests in flight there (this one included), `w` and `k` the backend's own waiting count
//!   and KV-cache use (0 without a scrape);
//! - TPOT = φ·[1, r, C, k] — `C` context (prompt) tokens in flight there.
//!
//! Statistics `S = Σ γ x xᵀ`, `b = Σ γ x y`, with `γ = max(e^(−Δt/τ), 0.98)` — τ = 60 s, or the
//! last ~50 samples when they come slower than that (long requests, light traffic): a completion costs
//! one decay and 36 + 6 multiply-adds; the 6×6 system `(S + λD) θ = b + λD θ₀` is solved by
//! Cholesky at most every 10 ms (a few hundred ns with the active set below) and θ is clamped to
//! θ ≥ 0 by an active set (a latency never falls as load rises). A query is a dot product.
//! Ridge: `D = diag(S)` plus a floor, toward θ₀ = [the weighted mean of y, 0, …]: constant
//! in-flight makes `XᵀX` singular; the prior keeps the fit at "the mean" along such directions.
//!
//! **Error bound.** Latency noise grows with latency (a 2 s TTFT varies more than a 40 ms one),
//! so residuals are tracked as log-ratios `e = ln(y / ŷ)`, not in milliseconds (the design's
//! additive band under-covers at high load and over-covers idle): a quantile tracker
//! `q += η (1[e > q] − 0.1)` with `η = 0.1 · mean|e|` (larger while young) converges on the residuals' 90th
//! percentile, and `p90 = ŷ · e^q`. Residuals are Huber-clipped at 5 · mean|e| before the fit
//! sees them, so one stalled request does not drag θ. Each sample is scored *before* the fit
//! learns from it (prequential), so MAE and coverage are honest out-of-sample errors.
//!
//! **Calibrated** while the effective sample count is at least 20 and the coverage of the p90
//! band (an EWMA of `y ≤ p90`) is within [0.8, 0.97]. Below 0.8 the model has drifted (the
//! backend changed): S and b are scaled by 0.1 so new samples dominate. An instance that gets
//! no traffic sees its effective count decay with τ, so after a few minutes it is uncalibrated
//! again and the balancer explores it (its old θ is not trusted forever).

// Small dense linear algebra reads best with indices (Cholesky's i, j, k).
#![allow(clippy::needless_range_loop)]

use crate::types::Millis;

/// Decay time constant of the statistics.
pub const TAU_MS: f64 = 60_000.0;
/// Each sample keeps at least this much of the past (a memory of ~50 samples): with requests
/// seconds long and few at a time, 60 s of time decay alone would leave a handful of samples
/// and the model would never count as calibrated.
const RETAIN: f64 = 0.98;
/// Effective samples before a model is trusted.
pub const MIN_SAMPLES: f64 = 20.0;
/// Effective samples before a model is asked at all by `attainable` (see `ttft_known`).
pub const KNOWN: f64 = 5.0;
const COVERAGE_LOW: f64 = 0.8;
const COVERAGE_HIGH: f64 = 0.97;
const RIDGE: f64 = 1e-3;
/// The least time between two solves of θ.
const SOLVE_MS: Millis = 10;
/// Floor of a prediction (ms): log-ratios need a positive ŷ.
const FLOOR_MS: f64 = 0.5;

/// One EWLS regression with its residual tracker. `N` features (the first is the constant 1).
#[derive(Clone, Debug)]
pub struct Ewls<const N: usize> {
    s: [[f64; N]; N],
    b: [f64; N],
    /// The fitted coefficients. (`s[0][0]` is Σγ, the effective count; `b[0] / s[0][0]` the
    /// weighted mean of y, the prior's intercept.)
    theta: [f64; N],
    /// When the statistics were last decayed.
    at: Millis,
    /// Log-ratio residuals: 90th-percentile tracker, mean absolute value.
    q: f64,
    /// `e^q`, kept with `q` so a query costs no `exp`.
    q_factor: f64,
    mae_log: f64,
    /// Mean absolute error in ms (EWMA), and the share of samples within the p90 band.
    mae_ms: f64,
    coverage: f64,
    samples: u64,
    /// Samples since the band last started afresh (the first, or a drift).
    since_reset: u64,
    /// When θ was last solved for; samples since then wait for the next solve.
    solved_at: Millis,
    stale: bool,
    /// It has been calibrated at some point (the warm-up is over).
    warmed: bool,
}

impl<const N: usize> Default for Ewls<N> {
    fn default() -> Self {
        Self {
            s: [[0.0; N]; N],
            b: [0.0; N],
            theta: [0.0; N],
            at: 0,
            q: 0.0,
            q_factor: 1.0,
            mae_log: 0.0,
            mae_ms: 0.0,
            coverage: 0.9,
            samples: 0,
            since_reset: 0,
            solved_at: 0,
            stale: false,
            warmed: false,
        }
    }
}

impl<const N: usize> Ewls<N> {
    /// The mean prediction for `x` (ms), floored.
    #[inline]
    pub fn mean(&self, x: &[f64; N]) -> f64 {
        let mut y = 0.0;
        for j in 0..N {
            y += self.theta[j] * x[j];
        }
        y.max(FLOOR_MS)
    }

    /// The p90 prediction for `x` (ms).
    #[inline]
    pub fn p90(&self, x: &[f64; N]) -> f64 {
        self.mean(x) * self.q_factor
    }

    /// Effective sample count at `now` (Σγ, decayed).
    pub fn effective(&self, now: Millis) -> f64 {
        self.s[0][0] * decay(self.at, now)
    }

    pub fn calibrated(&self, now: Millis) -> bool {
        self.effective(now) >= MIN_SAMPLES
            && (COVERAGE_LOW..=COVERAGE_HIGH).contains(&self.coverage)
    }

    /// Whether it has ever been calibrated.
    pub fn warmed(&self) -> bool {
        self.warmed
    }

    pub fn mae_ms(&self) -> f64 {
        self.mae_ms
    }

    pub fn coverage(&self) -> f64 {
        self.coverage
    }

    pub fn samples(&self) -> u64 {
        self.samples
    }

    /// Learns one observation `y` (ms) at features `x`.
    pub fn observe(&mut self, x: &[f64; N], y: f64, now: Millis) {
        if !y.is_finite() || y < 0.0 {
            return;
        }
        let y = y.max(FLOOR_MS);
        let fresh = self.samples == 0;
        // Score first (prequential), then learn.
        let mut y_fit = y;
        if !fresh {
            let mean = self.mean(x);
            let p90 = mean * self.q_factor;
            let e = (y / mean).ln();
            // SPEC §17: "its predictions and their error" — the error of predictions made
            // before the sample was seen.
            self.mae_ms += 0.05 * ((y - mean).abs() - self.mae_ms);
            self.coverage += 0.02 * (f64::from(u8::from(y <= p90)) - self.coverage);
            let scale = self.mae_log.max(0.01);
            // Large steps while the band is young, then 0.1 · mean|e| (a fast start, a steady
            // p90 after).
            let eta = scale * (1.0 / ((1 + self.since_reset) as f64).sqrt()).max(0.1);
            self.q += eta * (f64::from(u8::from(e > self.q)) - 0.1);
            self.q = self.q.clamp(-2.0, 4.0);
            self.q_factor = self.q.exp();
            self.mae_log += 0.05 * (e.abs() - self.mae_log);
            // Huber clip: an outlier moves the fit at most 5 mean errors.
            let bound = 5.0 * scale;
            if self.samples >= 8 && e.abs() > bound {
                y_fit = mean * e.clamp(-bound, bound).exp();
            }
            self.since_reset += 1;
            if self.since_reset >= 100 && self.coverage < COVERAGE_LOW {
                // Drift: forget most of the past; the band starts again from the new errors.
                self.forget(0.1);
                self.coverage = 0.9;
                self.q = 0.0;
                self.q_factor = 1.0;
                self.since_reset = 0;
            }
        }
        let g = decay(self.at, now).max(RETAIN);
        self.at = self.at.max(now);
        for j in 0..N {
            self.b[j] = self.b[j] * g + x[j] * y_fit;
            for k in 0..N {
                self.s[j][k] = self.s[j][k] * g + x[j] * x[k];
            }
        }
        self.samples += 1;
        // Solved at most every SOLVE_MS (and for every one of the first samples): at a
        // thousand completions a second the fit costs a hundred solves, not a thousand.
        self.stale = true;
        if self.samples <= 64 || now >= self.solved_at.saturating_add(SOLVE_MS) {
            self.solve();
            self.solved_at = now;
            self.stale = false;
        }
        self.warmed |= self.calibrated(now);
    }

    /// Solves for θ if samples came since the last solve (`tick` calls it, so a burst's last
    /// samples are not left out until the next completion).
    pub fn refresh(&mut self, now: Millis) {
        if self.stale && now >= self.solved_at.saturating_add(SOLVE_MS) {
            self.solve();
            self.solved_at = now;
            self.stale = false;
        }
    }

    fn forget(&mut self, f: f64) {
        for j in 0..N {
            self.b[j] *= f;
            for k in 0..N {
                self.s[j][k] *= f;
            }
        }
    }

    /// θ = argmin of the ridge objective with θⱼ ≥ 0 (j ≥ 1; the intercept too), by an
    /// active set: solve, pin the most negative coefficient at 0, repeat (at most N times).
    fn solve(&mut self) {
        let n = self.s[0][0];
        if n <= 0.0 {
            return;
        }
        let prior_mean = self.b[0] / n;
        let mut free = [true; N];
        for _ in 0..N {
            let mut a = [[0.0; N]; N];
            let mut rhs = [0.0; N];
            for j in 0..N {
                // Ridge relative to each feature's own scale, plus a floor for features never
                // seen non-zero.
                let d = RIDGE * self.s[j][j] + 1e-6 * n.max(1.0);
                let prior = if j == 0 { prior_mean } else { 0.0 };
                if free[j] {
                    rhs[j] = self.b[j] + d * prior;
                    for k in 0..N {
                        a[j][k] = if free[k] { self.s[j][k] } else { 0.0 };
                    }
                    a[j][j] += d;
                } else {
                    a[j][j] = 1.0;
                }
            }
            let Some(theta) = cholesky_solve(&a, &rhs) else {
                return;
            };
            let worst = (0..N)
                .filter(|&j| free[j] && theta[j] < 0.0)
                .min_by(|&i, &j| theta[i].total_cmp(&theta[j]));
            match worst {
                None => {
                    self.theta = theta;
                    return;
                }
                Some(j) => free[j] = false,
            }
        }
    }
}

#[inline]
fn decay(from: Millis, to: Millis) -> f64 {
    if to <= from {
        1.0
    } else {
        (-((to - from) as f64) / TAU_MS).exp()
    }
}

/// Solves `a x = rhs` for a symmetric positive definite `a`; `None` if it is not.
fn cholesky_solve<const N: usize>(a: &[[f64; N]; N], rhs: &[f64; N]) -> Option<[f64; N]> {
    let mut l = [[0.0; N]; N];
    for i in 0..N {
        for j in 0..=i {
            let mut sum = a[i][j];
            for k in 0..j {
                sum -= l[i][k] * l[j][k];
            }
            if i == j {
                if sum <= 0.0 || !sum.is_finite() {
                    return None;
                }
                l[i][i] = sum.sqrt();
            } else {
                l[i][j] = sum / l[j][j];
            }
        }
    }
    let mut y = [0.0; N];
    for i in 0..N {
        let mut sum = rhs[i];
        for k in 0..i {
            sum -= l[i][k] * y[k];
        }
        y[i] = sum / l[i][i];
    }
    let mut x = [0.0; N];
    for i in (0..N).rev() {
        let mut sum = y[i];
        for k in i + 1..N {
            sum -= l[k][i] * x[k];
        }
        x[i] = sum / l[i][i];
    }
    Some(x)
}

/// What an instance carries at one moment, as the models read it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Features {
    /// The request's prompt tokens.
    pub prompt: f64,
    /// Prompt tokens on the instance still awaiting their first token (others').
    pub awaiting: f64,
    /// Requests in flight there, this one included.
    pub running: f64,
    /// Context tokens in flight there, this one's included.
    pub context: f64,
    /// The backend's waiting count and KV-cache use in [0, 1].
    pub waiting: f64,
    pub cache: f64,
}

impl Features {
    #[inline]
    fn ttft(&self) -> [f64; 6] {
        [
            1.0,
            self.prompt,
            self.awaiting,
            self.running,
            self.waiting,
            self.cache,
        ]
    }

    #[inline]
    fn tpot(&self) -> [f64; 4] {
        [1.0, self.running, self.context, self.cache]
    }
}

/// An instance's two models.
#[derive(Clone, Debug, Default)]
pub struct LatencyModel {
    pub ttft: Ewls<6>,
    pub tpot: Ewls<4>,
}

impl LatencyModel {
    /// (p90 TTFT, p90 TPOT) in ms for a request with these features.
    #[inline]
    pub fn predict(&self, f: &Features) -> (f64, f64) {
        (self.ttft.p90(&f.ttft()), self.tpot.p90(&f.tpot()))
    }

    /// Mean TTFT and TPOT (ms).
    #[inline]
    pub fn mean(&self, f: &Features) -> (f64, f64) {
        (self.ttft.mean(&f.ttft()), self.tpot.mean(&f.tpot()))
    }

    pub fn observe_ttft(&mut self, f: &Features, ms: f64, now: Millis) {
        self.ttft.observe(&f.ttft(), ms, now);
    }

    pub fn observe_tpot(&mut self, f: &Features, ms: f64, now: Millis) {
        self.tpot.observe(&f.tpot(), ms, now);
    }

    /// Whether the TTFT model may be trusted now.
    pub fn ttft_calibrated(&self, now: Millis) -> bool {
        self.ttft.calibrated(now)
    }

    pub fn tpot_calibrated(&self, now: Millis) -> bool {
        self.tpot.calibrated(now)
    }

    /// Whether the TTFT model has enough recent samples to be asked at all (`KNOWN`), if not
    /// to be trusted as calibrated: what shedding and the hopeless-head horizon go by. Fewer,
    /// and they fail open.
    pub fn ttft_known(&self, now: Millis) -> bool {
        self.ttft.effective(now) >= KNOWN
    }

    /// Solves both models for what they learnt since their last solve.
    pub fn refresh(&mut self, now: Millis) {
        self.ttft.refresh(now);
        self.tpot.refresh(now);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::SplitMix64;

    fn feats(prompt: f64, running: f64) -> Features {
        Features {
            prompt,
            awaiting: 0.0,
            running,
            context: prompt * running,
            waiting: 0.0,
            cache: 0.0,
        }
    }

    fn noise(rng: &mut SplitMix64) -> f64 {
        // ±10 % uniform-ish, multiplicative
        0.9 + 0.2 * (rng.below(1_000_000) as f64 / 1e6)
    }

    #[test]
    fn learns_a_linear_ttft_and_its_p90_band() {
        let mut m = LatencyModel::default();
        let mut rng = SplitMix64::new(3);
        let truth = |f: &Features| 20.0 + 0.05 * f.prompt + 15.0 * f.running;
        let mut now = 0;
        for _ in 0..2000 {
            now += 10;
            let f = feats(rng.below(2000) as f64, 1.0 + rng.below(16) as f64);
            m.observe_ttft(&f, truth(&f) * noise(&mut rng), now);
        }
        assert!(
            m.ttft_calibrated(now),
            "{} {} {} {:?}",
            m.ttft.coverage,
            m.ttft.q,
            m.ttft.effective(now),
            m.ttft.theta
        );
        let f = feats(1000.0, 8.0);
        let (p90, _) = m.predict(&f);
        let mean = m.mean(&f).0;
        assert!((mean / truth(&f) - 1.0).abs() < 0.05, "mean {mean}");
        // p90 of a ±10 % uniform noise is +8 %
        assert!(p90 > truth(&f) * 1.02 && p90 < truth(&f) * 1.2, "p90 {p90}");
        let c = m.ttft.coverage();
        assert!((0.8..=0.97).contains(&c), "coverage {c}");
    }

    #[test]
    fn coefficients_never_go_negative() {
        let mut m = Ewls::<6>::default();
        // y falls with feature 1: the fit pins its coefficient at 0
        for i in 0..200u64 {
            let x = [1.0, (i % 10) as f64, 0.0, 1.0, 0.0, 0.0];
            m.observe(&x, 100.0 - 5.0 * x[1], i);
        }
        assert!(m.theta.iter().all(|&t| t >= 0.0), "{:?}", m.theta);
    }

    #[test]
    fn constant_features_do_not_break_the_fit() {
        let mut m = Ewls::<6>::default();
        for i in 0..100u64 {
            m.observe(&[1.0, 500.0, 0.0, 4.0, 0.0, 0.0], 80.0, i);
        }
        let y = m.mean(&[1.0, 500.0, 0.0, 4.0, 0.0, 0.0]);
        assert!((y - 80.0).abs() < 1.0, "{y}");
    }

    #[test]
    fn a_starved_model_loses_its_calibration() {
        let mut m = Ewls::<4>::default();
        for i in 0..100u64 {
            m.observe(&[1.0, 1.0, 100.0, 0.0], 10.0, i);
        }
        assert!(m.calibrated(100));
        // ln(100 / 20) τ ≈ 97 s later
        assert!(!m.calibrated(100 + 120_000));
    }

    #[test]
    fn drift_is_followed() {
        let mut m = Ewls::<4>::default();
        let x = [1.0, 2.0, 100.0, 0.0];
        let mut rng = SplitMix64::new(9);
        for i in 0..500u64 {
            m.observe(&x, 10.0 * noise(&mut rng), i * 10);
        }
        // the backend becomes 3x slower
        for i in 500..1000u64 {
            m.observe(&x, 30.0 * noise(&mut rng), i * 10);
        }
        let y = m.mean(&x);
        assert!((y / 30.0 - 1.0).abs() < 0.1, "{y}");
        assert!(
            m.calibrated(10_000),
            "{} {} {}",
            m.coverage,
            m.q,
            m.effective(10_000)
        );
    }
}
