//! Progress bars for long startup work (loading weights, warming up), drawn
//! from `tracing` events so the library crates stay free of terminal code.
//!
//! A crate reports progress with an event of target `mlxcel::progress` and
//! the fields `stage` (what is running, a short phrase), `done` and `total`
//! (units of that stage: layers, requests), at `debug` level:
//!
//! ```ignore
//! tracing::debug!(target: "mlxcel::progress", stage = "loading weights", done = 3, total = 30);
//! ```
//!
//! [`ProgressLayer`] turns them into one `indicatif` bar per stage, on
//! stderr when stderr is a terminal and nowhere otherwise (logs piped to a
//! file or journald get the ordinary log lines only). [`BarWriter`] writes
//! log lines above the live bar instead of through it.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::{IsTerminal, Write};
use std::sync::{Arc, Mutex, PoisonError};
use tracing::field::{Field, Visit};
use tracing::{Event, Subscriber};
use tracing_subscriber::layer::Context;
use tracing_subscriber::Layer;

/// The target of progress events.
pub const TARGET: &str = "mlxcel::progress";

/// The bar being drawn, shared by [`ProgressLayer`] and [`BarWriter`].
#[derive(Clone, Default)]
pub struct Bars {
    current: Arc<Mutex<Option<(String, ProgressBar)>>>,
}

impl Bars {
    /// The live bar (unfinished), if any.
    pub fn live(&self) -> Option<ProgressBar> {
        let guard = self.current.lock().unwrap_or_else(PoisonError::into_inner);
        guard
            .as_ref()
            .filter(|(_, bar)| !bar.is_finished())
            .map(|(_, bar)| bar.clone())
    }
}

/// A `tracing` layer that draws `mlxcel::progress` events as bars (see the
/// module docs). Events of other targets are ignored.
pub struct ProgressLayer {
    bars: Bars,
    target: fn() -> ProgressDrawTarget,
}

impl ProgressLayer {
    /// Draws on stderr when it is a terminal; hidden otherwise.
    pub fn stderr(bars: Bars) -> Self {
        fn target() -> ProgressDrawTarget {
            if std::io::stderr().is_terminal() {
                ProgressDrawTarget::stderr()
            } else {
                ProgressDrawTarget::hidden()
            }
        }
        ProgressLayer { bars, target }
    }

    /// Draws nowhere; the bars still count (tests read them).
    pub fn hidden(bars: Bars) -> Self {
        ProgressLayer {
            bars,
            target: ProgressDrawTarget::hidden,
        }
    }

    fn update(&self, stage: &str, done: u64, total: u64) {
        let mut current = self
            .bars
            .current
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let same = matches!(&*current, Some((s, bar)) if s == stage && !bar.is_finished());
        if !same {
            if let Some((_, old)) = current.take() {
                old.finish();
            }
            let bar = ProgressBar::with_draw_target(Some(total), (self.target)());
            if let Ok(style) = ProgressStyle::with_template(
                "{msg:>16} [{elapsed_precise}] [{wide_bar}] {pos}/{len} ({eta})",
            ) {
                bar.set_style(style.progress_chars("=> "));
            }
            bar.set_message(stage.to_string());
            *current = Some((stage.to_string(), bar));
        }
        if let Some((_, bar)) = &*current {
            bar.set_length(total);
            bar.set_position(done.min(total));
            if done >= total {
                bar.finish();
            }
        }
    }
}

impl<S: Subscriber> Layer<S> for ProgressLayer {
    fn on_event(&self, event: &Event<'_>, _ctx: Context<'_, S>) {
        if event.metadata().target() != TARGET {
            return;
        }
        let mut fields = ProgressFields::default();
        event.record(&mut fields);
        if let (Some(stage), Some(done), Some(total)) = (fields.stage, fields.done, fields.total) {
            self.update(&stage, done, total);
        }
    }
}

#[derive(Default)]
struct ProgressFields {
    stage: Option<String>,
    done: Option<u64>,
    total: Option<u64>,
}

impl Visit for ProgressFields {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "stage" {
            self.stage = Some(value.to_string());
        }
    }

    fn record_u64(&mut self, field: &Field, value: u64) {
        match field.name() {
            "done" => self.done = Some(value),
            "total" => self.total = Some(value),
            _ => {}
        }
    }

    fn record_i64(&mut self, field: &Field, value: i64) {
        if let Ok(v) = u64::try_from(value) {
            self.record_u64(field, v);
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "stage" {
            self.stage = Some(format!("{value:?}").trim_matches('"').to_string());
        }
    }
}

/// Stderr for log lines: while a bar is live, each line is written with
/// the bar cleared and redrawn below it.
#[derive(Clone)]
pub struct BarWriter {
    bars: Bars,
}

impl BarWriter {
    /// Writes to stderr around `bars`' live bar.
    pub fn new(bars: Bars) -> Self {
        BarWriter { bars }
    }
}

impl Write for BarWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match self.bars.live() {
            Some(bar) => bar.suspend(|| std::io::stderr().write(buf)),
            None => std::io::stderr().write(buf),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        std::io::stderr().flush()
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for BarWriter {
    type Writer = BarWriter;

    fn make_writer(&'a self) -> Self::Writer {
        self.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tracing_subscriber::layer::SubscriberExt;

    fn with_layer(f: impl FnOnce()) -> Bars {
        let bars = Bars::default();
        let subscriber = tracing_subscriber::registry().with(ProgressLayer::hidden(bars.clone()));
        tracing::subscriber::with_default(subscriber, f);
        bars
    }

    fn snapshot(bars: &Bars) -> Option<(String, u64, Option<u64>, bool)> {
        let guard = bars.current.lock().unwrap();
        guard.as_ref().map(|(stage, bar)| {
            (
                stage.clone(),
                bar.position(),
                bar.length(),
                bar.is_finished(),
            )
        })
    }

    #[test]
    fn events_move_one_bar_per_stage() {
        let bars = Bars::default();
        let subscriber = tracing_subscriber::registry().with(ProgressLayer::hidden(bars.clone()));
        tracing::subscriber::with_default(subscriber, || {
            tracing::debug!(target: "mlxcel::progress", stage = "loading weights", done = 1u64, total = 30u64);
            tracing::debug!(target: "mlxcel::progress", stage = "loading weights", done = 7u64, total = 30u64);
            assert_eq!(
                snapshot(&bars),
                Some(("loading weights".into(), 7, Some(30), false))
            );
            assert!(bars.live().is_some());
            tracing::debug!(target: "mlxcel::progress", stage = "loading weights", done = 30u64, total = 30u64);
            assert_eq!(
                snapshot(&bars),
                Some(("loading weights".into(), 30, Some(30), true))
            );
            assert!(bars.live().is_none(), "a finished bar is not live");
            // A new stage starts a new bar.
            tracing::debug!(target: "mlxcel::progress", stage = "warming up", done = 2u64, total = 9u64);
            assert_eq!(
                snapshot(&bars),
                Some(("warming up".into(), 2, Some(9), false))
            );
        });
    }

    #[test]
    fn other_targets_and_incomplete_events_draw_nothing() {
        let bars = with_layer(|| {
            tracing::info!(
                stage = "loading weights",
                done = 1u64,
                total = 3u64,
                "not progress"
            );
            tracing::debug!(target: "mlxcel::progress", stage = "loading weights", done = 1u64);
            tracing::debug!(target: "mlxcel::progress", done = 1u64, total = 3u64);
        });
        assert_eq!(snapshot(&bars), None);
    }

    #[test]
    fn loading_a_model_moves_the_bar_layer_by_layer() {
        // A tiny checkpoint of mlx_lm's classes (scripts/setup.sh writes it).
        let dir = std::env::var_os("MLXCEL_TINY_MODELS")
            .map(std::path::PathBuf::from)
            .unwrap_or_else(|| {
                std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/tiny-models")
            })
            .join("llama");
        let config = mlxcel_engine::loader::read_config(&dir).expect("tiny llama config");
        // Every layer, then the embedding and head.
        let layers = config.num_hidden_layers as u64 + 1;
        let bars = with_layer(|| {
            let options = mlxcel_model::LoadOptions {
                dtype: mlxcel_mlx::Dtype::Float32,
                weight_mode: mlxcel_model::WeightMode::Dequantized,
                quantize: None,
            };
            mlxcel_engine::loader::load_model(&dir, config, options).expect("tiny llama loads");
        });
        assert!(layers >= 2);
        assert_eq!(
            snapshot(&bars),
            Some(("loading weights".into(), layers, Some(layers), true))
        );
    }
}
