//! The watchdog that fails a step of the group that never returns, and
//! marks the runner's health broken.
//!
//! A collective that fails (a peer's connection closed) comes back as an
//! error; one that never returns (a peer that stopped answering) blocks
//! the engine thread, so [`Watchdog`] fails the requests in flight from
//! its own thread after the configured timeout. Either way rank 0 reports
//! unhealthy and refuses new requests: the group cannot be trusted any
//! more.

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::mpsc::UnboundedSender;

use crate::api::GenerationEvent;
use crate::error::StepError;
use crate::runner::RunnerHealth;

#[derive(Default)]
struct WatchState {
    /// The step being watched: its start and the requests to fail.
    armed: Option<(Instant, Vec<UnboundedSender<GenerationEvent>>)>,
    stop: bool,
}

/// Fails the requests of a step of the group that has run longer than the
/// timeout, from its own thread (the engine thread is the one blocked in
/// the collective), and marks the group broken.
pub(crate) struct Watchdog {
    state: Arc<(Mutex<WatchState>, Condvar)>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Watchdog {
    /// Starts the watchdog thread.
    pub(crate) fn start(timeout: Duration, health: Arc<RunnerHealth>) -> std::io::Result<Self> {
        let state: Arc<(Mutex<WatchState>, Condvar)> = Arc::default();
        let watched = Arc::clone(&state);
        let thread = std::thread::Builder::new()
            .name("mlxcel-tp-watchdog".into())
            .spawn(move || {
                let (lock, cv) = &*watched;
                let mut s = lock.lock().unwrap_or_else(|p| p.into_inner());
                loop {
                    if s.stop {
                        return;
                    }
                    let wait = match &s.armed {
                        None => timeout,
                        Some((since, _)) => match timeout.checked_sub(since.elapsed()) {
                            Some(left) => left,
                            None => {
                                let reason = format!(
                                    "a step of the tensor-parallel group did not finish in {} s \
                                     (--tensor-parallel-timeout): a rank stopped answering",
                                    timeout.as_secs_f64()
                                );
                                health.mark_broken(&reason);
                                if let Some((_, events)) = s.armed.take() {
                                    let failed = StepError::GroupBroken(reason.clone()).event();
                                    for e in events {
                                        let _ = e.send(failed.clone());
                                    }
                                }
                                continue;
                            }
                        },
                    };
                    s = cv
                        .wait_timeout(s, wait)
                        .map(|(g, _)| g)
                        .unwrap_or_else(|p| p.into_inner().0);
                }
            })?;
        Ok(Watchdog {
            state,
            thread: Some(thread),
        })
    }

    /// Watches a step from now; `events` are its requests' streams.
    pub(crate) fn arm(&self, events: Vec<UnboundedSender<GenerationEvent>>) {
        let (lock, cv) = &*self.state;
        lock.lock().unwrap_or_else(|p| p.into_inner()).armed = Some((Instant::now(), events));
        cv.notify_all();
    }

    /// The step is over.
    pub(crate) fn disarm(&self) {
        let (lock, _) = &*self.state;
        lock.lock().unwrap_or_else(|p| p.into_inner()).armed = None;
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        let (lock, cv) = &*self.state;
        lock.lock().unwrap_or_else(|p| p.into_inner()).stop = true;
        cv.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
