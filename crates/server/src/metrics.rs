//! `/metrics` in Prometheus text format (the `prometheus` crate).
//!
//! Two sources: what the HTTP layer sees (requests by endpoint and status;
//! per request TTFT, inter-token latency, end-to-end latency and token
//! counts, observed on the request's event stream), and the engine's
//! counters and gauges, copied from [`EngineStats`] at scrape time. Names
//! are `mlxcel_*`, in base units (seconds, tokens, blocks), counters end in
//! `_total`.

use std::time::Instant;

use mlxcel_engine_api::{EngineStats, EventStream, FailureKind, GenerationEvent};
use prometheus::{
    Encoder, GaugeVec, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};

/// Latency buckets in seconds (1 ms to 2 min).
const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];

/// Every metric the server exports.
pub struct Metrics {
    registry: Registry,
    requests: IntCounterVec,
    prompt_tokens: IntCounter,
    completion_tokens: IntCounter,
    cached_tokens: IntCounter,
    ttft: Histogram,
    itl: Histogram,
    e2e: HistogramVec,
    /// Failed requests by [`FailureKind`].
    failures: IntCounterVec,
    engine: EngineMetrics,
    /// One scrape at a time: engine counters catch up by difference, which
    /// two concurrent scrapes would add twice.
    scrape: std::sync::Mutex<()>,
}

/// Engine-side series, refreshed from a stats snapshot at scrape time.
struct EngineMetrics {
    blocks: IntGaugeVec,
    /// Blocks per KV group and state.
    group_blocks: IntGaugeVec,
    sequences: IntGaugeVec,
    prefix_enabled: IntGauge,
    prefix: IntCounterVec,
    prefix_tokens_reused: IntCounter,
    /// The disk tier: files and bytes on disk, and its events.
    disk: IntGaugeVec,
    disk_events: IntCounterVec,
    /// A hybrid model's recurrent-state snapshots: kept and capacity, and
    /// their events.
    recurrent_snapshots: IntGaugeVec,
    recurrent_snapshot_events: IntCounterVec,
    steps: IntCounterVec,
    step_tokens: IntCounterVec,
    failed_steps: IntCounter,
    attention_rows: IntCounterVec,
    /// Draft tokens proposed and accepted, per method.
    speculative_tokens: IntCounterVec,
    /// Rows that verified drafts, per method.
    speculative_verifications: IntCounterVec,
    /// Accepted / proposed since start, per method.
    speculative_acceptance: GaugeVec,
    /// Tokens a verification emits on average (accepted drafts + 1).
    speculative_tokens_per_verification: GaugeVec,
}

fn gauge_vec(name: &str, help: &str, labels: &[&str]) -> GaugeVec {
    GaugeVec::new(Opts::new(name, help), labels).expect("valid metric definition")
}

fn counter_vec(name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric definition")
}

fn counter(name: &str, help: &str) -> IntCounter {
    IntCounter::new(name, help).expect("valid metric definition")
}

fn histogram(name: &str, help: &str) -> Histogram {
    Histogram::with_opts(HistogramOpts::new(name, help).buckets(LATENCY_BUCKETS.to_vec()))
        .expect("valid metric definition")
}

impl EngineMetrics {
    fn new() -> Self {
        EngineMetrics {
            blocks: IntGaugeVec::new(
                Opts::new("mlxcel_kv_blocks", "KV pool blocks by state"),
                &["state"],
            )
            .expect("valid metric definition"),
            group_blocks: IntGaugeVec::new(
                Opts::new(
                    "mlxcel_kv_group_blocks",
                    "KV pool blocks per KV group (layers sharing one attention window; \
                     window=\"full\" for full attention) by state",
                ),
                &["group", "window", "state"],
            )
            .expect("valid metric definition"),
            sequences: IntGaugeVec::new(
                Opts::new(
                    "mlxcel_sequences",
                    "Requests running or waiting for admission",
                ),
                &["state"],
            )
            .expect("valid metric definition"),
            prefix_enabled: IntGauge::new("mlxcel_prefix_cache_enabled", "1 when on")
                .expect("valid metric definition"),
            prefix: counter_vec(
                "mlxcel_prefix_cache_events_total",
                "Prefix-cache lookups, hits, misses, block inserts and evictions",
                &["event"],
            ),
            prefix_tokens_reused: counter(
                "mlxcel_prefix_cache_tokens_reused_total",
                "Prompt tokens served from the prefix cache",
            ),
            disk: IntGaugeVec::new(
                Opts::new(
                    "mlxcel_prompt_cache_disk",
                    "The prompt cache's disk tier: block files (what=\"blocks\"), \
                     recurrent-state snapshot files (what=\"snapshots\"), their bytes \
                     (what=\"bytes\"), the size bound (what=\"capacity_bytes\"), 1 while writes \
                     are on (what=\"writable\"); absent without --prompt-cache-dir",
                ),
                &["what"],
            )
            .expect("valid metric definition"),
            disk_events: counter_vec(
                "mlxcel_prompt_cache_disk_events_total",
                "The prompt cache's disk tier: blocks read back (hit), recurrent-state \
                 snapshots read back (snapshot_hit), files written (write), \
                 bytes written (write_bytes), files removed for the size bound (eviction), \
                 files skipped as corrupt, truncated, foreign or unreadable (skipped), \
                 failed writes (write_error)",
                &["event"],
            ),
            recurrent_snapshots: IntGaugeVec::new(
                Opts::new(
                    "mlxcel_recurrent_state_snapshots",
                    "A hybrid model's recurrent-state snapshots for the prefix cache: kept now \
                     (what=\"kept\"), the most kept (what=\"capacity\"); absent for a model \
                     without recurrent layers",
                ),
                &["what"],
            )
            .expect("valid metric definition"),
            recurrent_snapshot_events: counter_vec(
                "mlxcel_recurrent_state_snapshot_events_total",
                "A hybrid model's recurrent-state snapshots taken at block boundaries (taken) and \
                 dropped for room (eviction)",
                &["event"],
            ),
            steps: counter_vec(
                "mlxcel_steps_total",
                "Engine steps with prefill rows / decode rows / decode steps queued before the previous step's tokens were read (pipelined) / pipelined steps with verification rows (pipelined_verify) / queued steps rolled back unread after a rejected draft (discarded)",
                &["kind"],
            ),
            step_tokens: counter_vec(
                "mlxcel_step_tokens_total",
                "Tokens run by engine steps (prefill, decode, and pad tokens rewound)",
                &["kind"],
            ),
            failed_steps: counter(
                "mlxcel_failed_steps_total",
                "Engine steps that failed (their requests failed)",
            ),
            attention_rows: counter_vec(
                "mlxcel_attention_rows_total",
                "Decode rows by attention path",
                &["path"],
            ),
            speculative_tokens: counter_vec(
                "mlxcel_speculative_tokens_total",
                "Draft tokens of speculative decoding, proposed and accepted, by method",
                &["method", "kind"],
            ),
            speculative_verifications: counter_vec(
                "mlxcel_speculative_verifications_total",
                "Decode rows that verified draft tokens (one per row and step), by method",
                &["method"],
            ),
            speculative_acceptance: gauge_vec(
                "mlxcel_speculative_acceptance_rate",
                "Accepted over proposed draft tokens since start, by method",
                &["method"],
            ),
            speculative_tokens_per_verification: gauge_vec(
                "mlxcel_speculative_tokens_per_verification",
                "Tokens one verification emits on average (accepted drafts plus the model's own), by method",
                &["method"],
            ),
        }
    }

    fn register(&self, r: &Registry) -> prometheus::Result<()> {
        r.register(Box::new(self.blocks.clone()))?;
        r.register(Box::new(self.group_blocks.clone()))?;
        r.register(Box::new(self.sequences.clone()))?;
        r.register(Box::new(self.prefix_enabled.clone()))?;
        r.register(Box::new(self.prefix.clone()))?;
        r.register(Box::new(self.prefix_tokens_reused.clone()))?;
        r.register(Box::new(self.disk.clone()))?;
        r.register(Box::new(self.disk_events.clone()))?;
        r.register(Box::new(self.recurrent_snapshots.clone()))?;
        r.register(Box::new(self.recurrent_snapshot_events.clone()))?;
        r.register(Box::new(self.steps.clone()))?;
        r.register(Box::new(self.step_tokens.clone()))?;
        r.register(Box::new(self.failed_steps.clone()))?;
        r.register(Box::new(self.attention_rows.clone()))?;
        r.register(Box::new(self.speculative_tokens.clone()))?;
        r.register(Box::new(self.speculative_verifications.clone()))?;
        r.register(Box::new(self.speculative_acceptance.clone()))?;
        r.register(Box::new(self.speculative_tokens_per_verification.clone()))
    }

    /// Copies `s` into the series (counters move by the difference).
    fn refresh(&self, s: &EngineStats) {
        let as_i64 = |v: usize| i64::try_from(v).unwrap_or(i64::MAX);
        for (state, v) in [
            ("total", s.kv_blocks_total),
            ("used", s.kv_blocks_used),
            ("free", s.kv_blocks_free),
            ("cached", s.kv_blocks_cached),
            ("active", s.kv_blocks_active),
        ] {
            self.blocks.with_label_values(&[state]).set(as_i64(v));
        }
        for (g, group) in s.kv_groups.iter().enumerate() {
            let (index, window) = (
                g.to_string(),
                group
                    .window
                    .map_or_else(|| "full".to_string(), |w| w.to_string()),
            );
            for (state, v) in [
                ("total", group.blocks_total),
                ("used", group.blocks_used),
                ("free", group.blocks_free),
                ("cached", group.blocks_cached),
                ("active", group.blocks_active),
            ] {
                self.group_blocks
                    .with_label_values(&[&index, &window, state])
                    .set(as_i64(v));
            }
        }
        self.sequences
            .with_label_values(&["running"])
            .set(as_i64(s.running));
        self.sequences
            .with_label_values(&["waiting"])
            .set(as_i64(s.waiting));
        self.prefix_enabled.set(i64::from(s.prefix_cache_enabled));
        for (event, v) in [
            ("lookup", s.prefix_cache_lookups),
            ("hit", s.prefix_cache_hits),
            ("miss", s.prefix_cache_misses),
            ("insert", s.prefix_cache_inserts),
            ("eviction", s.prefix_cache_evictions),
        ] {
            catch_up(&self.prefix.with_label_values(&[event]), v);
        }
        catch_up(&self.prefix_tokens_reused, s.prefix_cache_tokens_reused);
        if let Some(d) = &s.disk {
            for (what, v) in [
                ("blocks", d.blocks),
                ("snapshots", d.snapshots),
                ("bytes", d.bytes),
                ("capacity_bytes", d.capacity_bytes),
                ("writable", u64::from(d.writable)),
            ] {
                self.disk
                    .with_label_values(&[what])
                    .set(i64::try_from(v).unwrap_or(i64::MAX));
            }
            for (event, v) in [
                ("hit", d.hits),
                ("snapshot_hit", d.snapshot_hits),
                ("write", d.writes),
                ("write_bytes", d.write_bytes),
                ("eviction", d.evictions),
                ("skipped", d.skipped),
                ("write_error", d.write_errors),
            ] {
                catch_up(&self.disk_events.with_label_values(&[event]), v);
            }
        }
        if let Some(r) = &s.recurrent {
            for (what, v) in [("kept", r.snapshots), ("capacity", r.snapshot_capacity)] {
                self.recurrent_snapshots
                    .with_label_values(&[what])
                    .set(as_i64(v));
            }
            for (event, v) in [
                ("taken", r.snapshots_taken),
                ("eviction", r.snapshots_evicted),
            ] {
                catch_up(
                    &self.recurrent_snapshot_events.with_label_values(&[event]),
                    v,
                );
            }
        }
        catch_up(&self.steps.with_label_values(&["prefill"]), s.prefill_steps);
        catch_up(&self.steps.with_label_values(&["decode"]), s.decode_steps);
        catch_up(
            &self.steps.with_label_values(&["pipelined"]),
            s.pipelined_steps,
        );
        catch_up(
            &self.steps.with_label_values(&["pipelined_verify"]),
            s.pipelined_verify_steps,
        );
        catch_up(
            &self.steps.with_label_values(&["discarded"]),
            s.discarded_steps,
        );
        catch_up(
            &self.step_tokens.with_label_values(&["prefill"]),
            s.prefill_tokens,
        );
        catch_up(
            &self.step_tokens.with_label_values(&["decode"]),
            s.decode_tokens,
        );
        catch_up(&self.step_tokens.with_label_values(&["pad"]), s.pad_tokens);
        catch_up(&self.failed_steps, s.failed_steps);
        catch_up(
            &self.attention_rows.with_label_values(&["batched"]),
            s.attention_batched_rows,
        );
        catch_up(
            &self.attention_rows.with_label_values(&["per_row"]),
            s.attention_per_row_rows,
        );
        let method = s.speculative_method.as_str();
        if !method.is_empty() && method != "off" {
            let (proposed, accepted, verified) = (
                s.speculative_proposed_tokens,
                s.speculative_accepted_tokens,
                s.speculative_verifications,
            );
            catch_up(
                &self
                    .speculative_tokens
                    .with_label_values(&[method, "proposed"]),
                proposed,
            );
            catch_up(
                &self
                    .speculative_tokens
                    .with_label_values(&[method, "accepted"]),
                accepted,
            );
            catch_up(
                &self.speculative_verifications.with_label_values(&[method]),
                verified,
            );
            let ratio = |a: u64, b: u64| if b == 0 { 0.0 } else { a as f64 / b as f64 };
            self.speculative_acceptance
                .with_label_values(&[method])
                .set(ratio(accepted, proposed));
            self.speculative_tokens_per_verification
                .with_label_values(&[method])
                .set(ratio(accepted + verified, verified));
        }
    }
}

/// Moves a counter up to the engine's monotonic value.
fn catch_up(c: &IntCounter, value: u64) {
    let now = c.get();
    if value > now {
        c.inc_by(value - now);
    }
}

impl Metrics {
    /// All series, registered in a fresh registry.
    pub fn new() -> Self {
        let m = Metrics {
            registry: Registry::new(),
            requests: counter_vec(
                "mlxcel_http_requests_total",
                "HTTP requests by endpoint and status code",
                &["endpoint", "status"],
            ),
            prompt_tokens: counter(
                "mlxcel_prompt_tokens_total",
                "Prompt tokens of finished requests",
            ),
            completion_tokens: counter(
                "mlxcel_completion_tokens_total",
                "Completion tokens of finished requests",
            ),
            cached_tokens: counter(
                "mlxcel_prompt_cached_tokens_total",
                "Prompt tokens of finished requests served from the prefix cache",
            ),
            ttft: histogram(
                "mlxcel_time_to_first_token_seconds",
                "Time from request arrival to its first token",
            ),
            itl: histogram(
                "mlxcel_inter_token_latency_seconds",
                "Time between consecutive tokens of a request",
            ),
            e2e: HistogramVec::new(
                HistogramOpts::new(
                    "mlxcel_request_duration_seconds",
                    "Generation requests from arrival to their end, by outcome",
                )
                .buckets(LATENCY_BUCKETS.to_vec()),
                &["outcome"],
            )
            .expect("valid metric definition"),
            failures: counter_vec(
                "mlxcel_request_failures_total",
                "Requests the engine failed, by kind of failure (model, out_of_memory, \
                 kv_cache, output, internal, group_broken, shutdown)",
                &["kind"],
            ),
            engine: EngineMetrics::new(),
            scrape: std::sync::Mutex::new(()),
        };
        m.register().expect("metric names are unique");
        // Every kind shows, at 0 until it happens.
        for kind in FailureKind::ALL {
            m.failures.with_label_values(&[kind.as_str()]);
        }
        m
    }

    fn register(&self) -> prometheus::Result<()> {
        let r = &self.registry;
        r.register(Box::new(self.requests.clone()))?;
        r.register(Box::new(self.prompt_tokens.clone()))?;
        r.register(Box::new(self.completion_tokens.clone()))?;
        r.register(Box::new(self.cached_tokens.clone()))?;
        r.register(Box::new(self.ttft.clone()))?;
        r.register(Box::new(self.itl.clone()))?;
        r.register(Box::new(self.e2e.clone()))?;
        r.register(Box::new(self.failures.clone()))?;
        self.engine.register(r)
    }

    /// Counts one HTTP response.
    pub fn record_request(&self, endpoint: &str, status: u16) {
        self.requests
            .with_label_values(&[endpoint, &status.to_string()])
            .inc();
    }

    /// The text exposition, engine series refreshed from `stats`.
    pub fn render(&self, stats: &EngineStats) -> Result<String, String> {
        let _one_at_a_time = self.scrape.lock().unwrap_or_else(|p| p.into_inner());
        self.engine.refresh(stats);
        let mut out = Vec::new();
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut out)
            .map_err(|e| e.to_string())?;
        String::from_utf8(out).map_err(|e| e.to_string())
    }

    /// Wraps a request's event stream so that its TTFT, inter-token
    /// latencies, duration and token counts are observed as events pass.
    /// Dropping the returned stream drops the engine's (cancellation).
    pub fn instrument(
        self: &std::sync::Arc<Self>,
        mut events: EventStream,
        arrived: Instant,
    ) -> EventStream {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let metrics = std::sync::Arc::clone(self);
        tokio::spawn(async move {
            let mut seen = Seen::default();
            let mut outcome = "cancelled";
            loop {
                let event = tokio::select! {
                    e = events.recv() => e,
                    () = tx.closed() => None,
                };
                let Some(event) = event else { break };
                outcome = metrics
                    .observe(&event, arrived, &mut seen)
                    .unwrap_or(outcome);
                if tx.send(event).is_err() {
                    break;
                }
            }
            metrics
                .e2e
                .with_label_values(&[outcome])
                .observe(arrived.elapsed().as_secs_f64());
        });
        rx
    }

    /// Observes one event; returns the request's outcome when it ends.
    fn observe(
        &self,
        event: &GenerationEvent,
        arrived: Instant,
        seen: &mut Seen,
    ) -> Option<&'static str> {
        match event {
            GenerationEvent::Delta { index, .. } => {
                let now = Instant::now();
                if !seen.first_token {
                    seen.first_token = true;
                    self.ttft.observe((now - arrived).as_secs_f64());
                }
                if let Some(prev) = seen.last_token.insert(*index, now) {
                    self.itl.observe((now - prev).as_secs_f64());
                }
                None
            }
            GenerationEvent::PromptLogprobs { .. }
            | GenerationEvent::ToolCallStart { .. }
            | GenerationEvent::ToolCallArguments { .. } => None,
            GenerationEvent::Finished { usage, .. } => {
                // Every choice reports the prompt they share: count it once.
                if !seen.prompt_counted {
                    seen.prompt_counted = true;
                    self.prompt_tokens.inc_by(usage.prompt_tokens as u64);
                    self.cached_tokens.inc_by(usage.cached_tokens as u64);
                }
                self.completion_tokens
                    .inc_by(usage.completion_tokens as u64);
                Some("finished")
            }
            GenerationEvent::Embedding { usage, .. } => {
                self.prompt_tokens.inc_by(usage.prompt_tokens as u64);
                self.cached_tokens.inc_by(usage.cached_tokens as u64);
                Some("finished")
            }
            GenerationEvent::Failed { kind, .. } => {
                // A failed request may fail each of its choices: count it
                // once.
                if !seen.failed {
                    seen.failed = true;
                    self.failures.with_label_values(&[kind.as_str()]).inc();
                }
                Some("failed")
            }
        }
    }
}

/// What one request's stream has shown so far.
#[derive(Debug, Default)]
struct Seen {
    /// A token arrived (TTFT observed).
    first_token: bool,
    /// Per choice: when its last token arrived (inter-token latency is
    /// measured within a choice).
    last_token: std::collections::HashMap<usize, Instant>,
    /// The prompt's tokens were counted.
    prompt_counted: bool,
    /// A failure was counted.
    failed: bool,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}
