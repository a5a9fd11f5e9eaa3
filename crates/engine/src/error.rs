//! The engine's errors: [`EngineError`] (start-up), [`StepError`] (the
//! step path: everything that can fail a request after it was admitted,
//! typed by kind all the way to the HTTP edge, which maps each kind to a
//! status code, and `/metrics`, which counts failures by kind) and
//! [`GroupError`] (a tensor-parallel group's collectives).

use crate::api::{FailureKind, GenerationEvent};

/// Errors of [`Engine::start`].
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The tokenizer or the chat template could not be loaded.
    #[error(transparent)]
    Text(#[from] mlxcel_text::TextError),
    /// The checkpoint could not be read or is not supported.
    #[error(transparent)]
    Model(#[from] mlxcel_model::ModelError),
    /// MLX refused a device setting or an allocation.
    #[error(transparent)]
    Mlx(#[from] mlxcel_mlx::Error),
    /// The KV cache could not be built.
    #[error(transparent)]
    Kv(#[from] mlxcel_kv::KvError),
    /// The engine thread could not start, or died while loading.
    #[error("engine thread: {0}")]
    Thread(String),
    /// The options contradict each other or the model.
    #[error("bad engine option: {0}")]
    Config(String),
    /// The tensor-parallel group failed (a collective, a plan).
    #[error(transparent)]
    Group(#[from] GroupError),
    /// A tensor-parallel follower's step failed.
    #[error("follower step: {0}")]
    FollowerStep(StepError),
    /// A step failed during start-up (the tensor-parallel set-up).
    #[error(transparent)]
    Step(#[from] StepError),
}

/// A failure of the tensor-parallel group.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GroupError {
    /// A collective failed (a peer's connection closed).
    #[error("tensor parallelism: {0}")]
    Collective(#[from] mlxcel_mlx::Error),
    /// A plan that could not be written or read as JSON.
    #[error("tensor parallelism: a plan that does not (de)serialize: {0}")]
    Json(String),
    /// A plan whose length word does not match its words.
    #[error("tensor parallelism: a plan of {bytes} bytes in {words} words")]
    Length { bytes: i64, words: usize },
    /// A plan out of order (a step before the set-up, a second set-up).
    #[error("tensor parallelism: {0}")]
    Protocol(&'static str),
}

/// Why a step (or the work after it for one row) failed.
///
/// A step error fails the requests of that step only (invariant 6); the
/// engine goes on, unless the tensor-parallel group is broken
/// ([`StepError::GroupBroken`]), after which no step can run.
#[derive(Debug, thiserror::Error)]
pub enum StepError {
    /// The KV bookkeeping refused an operation (a bug above the KV crate,
    /// or a pool exhausted despite admission).
    #[error(transparent)]
    Kv(mlxcel_kv::KvError),
    /// The model could not build the step.
    #[error(transparent)]
    Model(mlxcel_model::ModelError),
    /// MLX failed while evaluating the step.
    #[error(transparent)]
    Mlx(mlxcel_mlx::Error),
    /// MLX could not allocate what the step needs.
    #[error("out of memory: {0}")]
    OutOfMemory(mlxcel_mlx::Error),
    /// A panic inside the step, caught at the step boundary.
    #[error("internal error: {0}")]
    Panic(String),
    /// The tensor-parallel group stopped working (a rank failed or stopped
    /// answering): no step can run any more. The reason says so.
    #[error("{0}")]
    GroupBroken(String),
    /// The output grammar rejected a token or could not mask logits.
    #[error(transparent)]
    Grammar(#[from] mlxcel_text::constraint::ConstraintError),
    /// The tokenizer could not decode a sampled token.
    #[error(transparent)]
    Text(#[from] mlxcel_text::TextError),
    /// The engine's own bookkeeping broke a rule (a bug), reported instead
    /// of panicking.
    #[error("internal error: {0}")]
    Internal(&'static str),
    /// A row's forward was injected to fail (tests only).
    #[cfg(feature = "fault-injection")]
    #[error("injected fault (token {0})")]
    Injected(u32),
}

impl From<mlxcel_mlx::Error> for StepError {
    fn from(e: mlxcel_mlx::Error) -> Self {
        if e.is_out_of_memory() {
            StepError::OutOfMemory(e)
        } else {
            StepError::Mlx(e)
        }
    }
}

impl From<mlxcel_kv::KvError> for StepError {
    fn from(e: mlxcel_kv::KvError) -> Self {
        match e {
            mlxcel_kv::KvError::Mlx(e) => e.into(),
            e => StepError::Kv(e),
        }
    }
}

impl From<mlxcel_model::ModelError> for StepError {
    fn from(e: mlxcel_model::ModelError) -> Self {
        match e {
            mlxcel_model::ModelError::Mlx(e) => e.into(),
            mlxcel_model::ModelError::Kv(e) => e.into(),
            e => StepError::Model(e),
        }
    }
}

impl StepError {
    /// A panic payload caught at the step boundary.
    pub fn from_panic(panic: &(dyn std::any::Any + Send)) -> Self {
        StepError::Panic(
            panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "panic".into()),
        )
    }

    /// Whether the error means no step can run any more.
    pub fn is_group_broken(&self) -> bool {
        matches!(self, StepError::GroupBroken(_))
    }

    /// The kind of failure, as the front ends see it.
    pub fn kind(&self) -> FailureKind {
        match self {
            StepError::Kv(_) => FailureKind::KvCache,
            StepError::Model(_) | StepError::Mlx(_) => FailureKind::Model,
            StepError::OutOfMemory(_) => FailureKind::OutOfMemory,
            StepError::Panic(_) | StepError::Internal(_) => FailureKind::Internal,
            StepError::GroupBroken(_) => FailureKind::GroupBroken,
            StepError::Grammar(_) | StepError::Text(_) => FailureKind::Output,
            #[cfg(feature = "fault-injection")]
            StepError::Injected(_) => FailureKind::Model,
        }
    }

    /// The event that fails a request with this error.
    pub fn event(&self) -> GenerationEvent {
        GenerationEvent::Failed {
            kind: self.kind(),
            message: self.to_string(),
        }
    }
}
