//! Where a step's time goes: an opt-in profiler for `mlxcel generate
//! --profile` (findings in `docs/performance.md`).
//!
//! - [`ProfileMode::Steps`] adds no device syncs: each step records the
//!   host time spent building its graph, the time waiting in `eval`, the
//!   engine's host work around the forward, and the bridge calls it made
//!   (graph nodes, host uploads, evals, reads back).
//! - [`ProfileMode::Layers`] also evaluates at every [`mark`], so the time
//!   between two marks is the build *and* device time of that region (the
//!   sync per region distorts the total, not the split).
//!
//! Steps are grouped by kind (`prefill`, `decode`, or `decode x32`...), so
//! one report shows prefill, single-stream and batched decode apart. The
//! state is process-wide: only one engine thread runs forwards.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use mlxcel_mlx::{call_counts, Array, CallCounts};

use crate::ModelError;

/// What the profiler records.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ProfileMode {
    /// Nothing (the default; [`mark`] and [`region`] cost one atomic load).
    #[default]
    Off,
    /// Per-step host/eval split and bridge-call counts, no extra syncs.
    Steps,
    /// [`ProfileMode::Steps`] plus a device sync at every region mark.
    Layers,
}

static MODE: AtomicU8 = AtomicU8::new(0);
static STATE: Mutex<Option<State>> = Mutex::new(None);

#[derive(Default)]
struct Stat {
    calls: u64,
    seconds: f64,
}

struct State {
    kind: String,
    step_started: Instant,
    counts_at_start: CallCounts,
    last_mark: Instant,
    steps: BTreeMap<String, (u64, f64, CallCounts)>,
    regions: BTreeMap<(String, &'static str), Stat>,
}

/// Sets the profiler's mode (from `main`); resets what was recorded.
pub fn set_mode(mode: ProfileMode) {
    MODE.store(mode as u8, Ordering::Relaxed);
    let mut state = lock();
    *state = (mode != ProfileMode::Off).then(|| State {
        kind: String::new(),
        step_started: Instant::now(),
        counts_at_start: call_counts(),
        last_mark: Instant::now(),
        steps: BTreeMap::new(),
        regions: BTreeMap::new(),
    });
}

/// The profiler's mode.
pub fn mode() -> ProfileMode {
    match MODE.load(Ordering::Relaxed) {
        1 => ProfileMode::Steps,
        2 => ProfileMode::Layers,
        _ => ProfileMode::Off,
    }
}

fn lock() -> std::sync::MutexGuard<'static, Option<State>> {
    STATE.lock().unwrap_or_else(|p| p.into_inner())
}

/// Starts a step of `kind` (the engine calls it before planning's work).
pub fn begin_step(kind: impl Into<String>) {
    if mode() == ProfileMode::Off {
        return;
    }
    if let Some(s) = lock().as_mut() {
        s.kind = kind.into();
        s.step_started = Instant::now();
        s.last_mark = s.step_started;
        s.counts_at_start = call_counts();
    }
}

/// Ends the step begun by [`begin_step`]: its wall time and bridge calls.
pub fn end_step() {
    if mode() == ProfileMode::Off {
        return;
    }
    if let Some(s) = lock().as_mut() {
        let counts = call_counts().since(&s.counts_at_start);
        let e = s.steps.entry(s.kind.clone()).or_default();
        e.0 += 1;
        e.1 += s.step_started.elapsed().as_secs_f64();
        e.2 = CallCounts {
            ops: e.2.ops + counts.ops,
            uploads: e.2.uploads + counts.uploads,
            evals: e.2.evals + counts.evals,
            reads: e.2.reads + counts.reads,
        };
    }
}

/// Times `f` as region `name` of the current step (any mode but off).
pub fn region<T>(name: &'static str, f: impl FnOnce() -> T) -> T {
    if mode() == ProfileMode::Off {
        return f();
    }
    let t0 = Instant::now();
    let out = f();
    add(name, t0.elapsed().as_secs_f64());
    out
}

/// Charges the time since `since` to region `name` (any mode but off).
pub fn record(name: &'static str, since: Instant) {
    if mode() != ProfileMode::Off {
        add(name, since.elapsed().as_secs_f64());
    }
}

fn add(name: &'static str, seconds: f64) {
    if let Some(s) = lock().as_mut() {
        let key = (s.kind.clone(), name);
        let st = s.regions.entry(key).or_default();
        st.calls += 1;
        st.seconds += seconds;
        s.last_mark = Instant::now();
    }
}

/// In [`ProfileMode::Layers`]: evaluates `arrays` and charges the time since
/// the previous mark (graph building and device work) to region `name`.
/// A no-op otherwise.
///
/// # Errors
/// The evaluation's MLX error.
pub fn mark(name: &'static str, arrays: &[&Array]) -> Result<(), ModelError> {
    if mode() != ProfileMode::Layers {
        return Ok(());
    }
    mlxcel_mlx::eval(arrays)?;
    let since = lock()
        .as_ref()
        .map_or(0.0, |s| s.last_mark.elapsed().as_secs_f64());
    add(name, since);
    Ok(())
}

/// Restarts the region clock (after work that is not a region).
pub fn restart_clock() {
    if mode() != ProfileMode::Layers {
        return;
    }
    if let Some(s) = lock().as_mut() {
        s.last_mark = Instant::now();
    }
}

/// A text table of everything recorded: per step kind, steps, mean step
/// ms, graph nodes / uploads / evals / reads per step, then each region's
/// mean ms per step and share of the step.
pub fn report() -> String {
    let state = lock();
    let Some(s) = state.as_ref() else {
        return String::new();
    };
    let mut out = String::new();
    for (kind, (n, secs, c)) in &s.steps {
        let n = (*n).max(1) as f64;
        let step_ms = secs / n * 1e3;
        out.push_str(&format!(
            "{kind}: {} steps, {step_ms:.3} ms/step; per step: {:.0} graph nodes, {:.1} uploads, {:.1} evals, {:.1} reads\n",
            n as u64,
            c.ops as f64 / n,
            c.uploads as f64 / n,
            c.evals as f64 / n,
            c.reads as f64 / n,
        ));
        let mut rows: Vec<_> = s
            .regions
            .iter()
            .filter(|((k, _), _)| k == kind)
            .map(|((_, name), st)| (*name, st))
            .collect();
        rows.sort_by(|a, b| b.1.seconds.total_cmp(&a.1.seconds));
        for (name, st) in rows {
            let ms = st.seconds / n * 1e3;
            out.push_str(&format!(
                "  {name:<24} {ms:>9.3} ms/step {:>5.1}%  ({} calls)\n",
                100.0 * ms / step_ms.max(1e-9),
                st.calls
            ));
        }
    }
    out
}
