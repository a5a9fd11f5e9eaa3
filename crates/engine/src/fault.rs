//! Test-only fault injection (cargo feature `fault-injection`, never in a
//! release build): makes chosen forwards fail, to prove that a failing step
//! fails only its own requests (docs/architecture.md invariant 6).

/// Which forwards fail, and how.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FaultInjection {
    /// Any forward that runs this token id (in any row) fails.
    pub poison_token: Option<u32>,
    /// Fail by panicking (caught at the step boundary) instead of an error.
    pub panic: bool,
    /// Every write of the prompt cache's disk tier fails with this OS
    /// error (28: no space left on device).
    pub disk_write_errno: Option<i32>,
    /// The n-th read of a pipelined decode step (counting from 1) fails
    /// once, as a device error surfacing when the tokens are read would:
    /// the step and the one queued behind it are rolled back.
    pub fail_pipelined_read: Option<u64>,
}

impl FaultInjection {
    /// Fails when a row of the step holds the poison token.
    pub(crate) fn check(&self, rows: &[Vec<u32>]) -> Result<(), crate::error::StepError> {
        let Some(poison) = self.poison_token else {
            return Ok(());
        };
        if !rows.iter().any(|r| r.contains(&poison)) {
            return Ok(());
        }
        if self.panic {
            panic!("injected panic (token {poison})");
        }
        Err(crate::error::StepError::Injected(poison))
    }
}
