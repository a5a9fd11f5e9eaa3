//! The fields `/v1/chat/completions` and `/v1/completions` share: sampling,
//! penalties, stop strings, logit bias, `n`, streaming, `user`,
//! `cache_prompt`, `speculative`.

use std::collections::BTreeMap;

use mlxcel_engine_api::{GenerationRequest, Prompt, SamplingParams};

use super::{reject_unknown, StreamOptions, ValidationError};
use crate::openai::request::{self, SharedFields, Stop};

/// Most stop strings in a request.
const MAX_STOP: usize = 4;
/// Most choices per prompt.
const MAX_N: i128 = 16;

/// The shared fields of a request, checked.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct SharedParams {
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    pub logit_bias: Vec<(u32, f32)>,
    pub n: usize,
    pub stream: Option<StreamOptions>,
    pub user: Option<String>,
    pub cache_prompt: bool,
    pub speculative: bool,
    pub ignore_eos: bool,
    pub min_tokens: usize,
}

impl SharedParams {
    /// Checks the shared fields of a request.
    pub fn parse(fields: SharedFields) -> Result<Self, ValidationError> {
        let sampling = parse_sampling(&fields)?;
        let stop = match fields.stop {
            Some(stop) => parse_stop(stop)?,
            None => Vec::new(),
        };
        let logit_bias = match fields.logit_bias {
            Some(bias) => parse_logit_bias(bias)?,
            None => Vec::new(),
        };
        let n = match fields.n {
            Some(n) if !(1..=MAX_N).contains(&n) => return Err(ValidationError::NOutOfRange(n)),
            Some(n) => n as usize,
            None => 1,
        };
        let stream = parse_stream(fields.stream.unwrap_or(false), fields.stream_options)?;
        let min_tokens = match fields.min_tokens {
            Some(value) => usize::try_from(value).map_err(|_| ValidationError::WrongType {
                param: "min_tokens".into(),
                expected: "a non-negative integer",
            })?,
            None => 0,
        };
        Ok(Self {
            sampling,
            stop,
            logit_bias,
            n,
            stream,
            user: fields.user,
            cache_prompt: fields.cache_prompt.unwrap_or(true),
            speculative: fields.speculative.unwrap_or(true),
            ignore_eos: fields.ignore_eos.unwrap_or(false),
            min_tokens,
        })
    }

    /// Refuses a `min_tokens` above the request's `max_tokens`.
    pub fn check_min_tokens(&self, max_tokens: usize) -> Result<(), ValidationError> {
        if self.min_tokens > max_tokens {
            return Err(ValidationError::MinTokensAboveMax {
                min_tokens: self.min_tokens,
                max_tokens,
            });
        }
        Ok(())
    }

    /// A request of `prompt` with these settings (no logprobs, no tools,
    /// no response format: the caller adds its own).
    pub fn request(&self, prompt: Prompt, max_tokens: usize) -> GenerationRequest {
        GenerationRequest {
            stop: self.stop.clone(),
            logit_bias: self.logit_bias.clone(),
            n: self.n,
            cache_prompt: self.cache_prompt,
            speculative: self.speculative,
            ignore_eos: self.ignore_eos,
            min_tokens: self.min_tokens,
            ..GenerationRequest::new(prompt, self.sampling, max_tokens)
        }
    }
}

/// `param` as a token budget of at least 1, saturating at `usize::MAX`.
pub(super) fn max_tokens(param: &'static str, value: i128) -> Result<usize, ValidationError> {
    if value < 1 {
        return Err(ValidationError::MaxTokensTooSmall { param, value });
    }
    Ok(usize::try_from(value).unwrap_or(usize::MAX))
}

fn parse_sampling(fields: &SharedFields) -> Result<SamplingParams, ValidationError> {
    let mut sampling = SamplingParams::default();
    if let Some(t) = fields.temperature {
        if !(t.is_finite() && (0.0..=2.0).contains(&t)) {
            return Err(ValidationError::TemperatureOutOfRange(t));
        }
        sampling.temperature = t as f32;
    }
    if let Some(p) = fields.top_p {
        if !(p.is_finite() && p > 0.0 && p <= 1.0) {
            return Err(ValidationError::TopPOutOfRange(p));
        }
        sampling.top_p = p as f32;
    }
    if let Some(k) = fields.top_k {
        if k < 0 {
            return Err(ValidationError::TopKNegative(k));
        }
        sampling.top_k = usize::try_from(k).unwrap_or(usize::MAX);
    }
    if let Some(p) = fields.min_p {
        if !(p.is_finite() && (0.0..=1.0).contains(&p)) {
            return Err(ValidationError::MinPOutOfRange(p));
        }
        sampling.min_p = p as f32;
    }
    if let Some(seed) = fields.seed {
        // Negative seeds map to their two's-complement bits: distinct seeds
        // stay distinct and the mapping is stable.
        sampling.seed = Some(u64::try_from(seed).unwrap_or(seed as i64 as u64));
    }
    for (param, value) in [
        ("presence_penalty", fields.presence_penalty),
        ("frequency_penalty", fields.frequency_penalty),
    ] {
        let Some(value) = value else {
            continue;
        };
        if !(value.is_finite() && (-2.0..=2.0).contains(&value)) {
            return Err(ValidationError::PenaltyOutOfRange { param, value });
        }
        if param == "presence_penalty" {
            sampling.presence_penalty = value as f32;
        } else {
            sampling.frequency_penalty = value as f32;
        }
    }
    if let Some(r) = fields.repetition_penalty {
        if !(r.is_finite() && r > 0.0 && r <= 2.0) {
            return Err(ValidationError::RepetitionPenaltyOutOfRange(r));
        }
        sampling.repetition_penalty = r as f32;
    }
    Ok(sampling)
}

/// Up to 4 stop strings (`[]`: none, as `null`); none may be empty.
fn parse_stop(stop: Stop) -> Result<Vec<String>, ValidationError> {
    let items = match stop {
        Stop::One(stop) if stop.is_empty() => {
            return Err(ValidationError::EmptyStop {
                param: "stop".to_owned(),
            })
        }
        Stop::One(stop) => return Ok(vec![stop]),
        Stop::Many(items) => items,
    };
    if items.len() > MAX_STOP {
        return Err(ValidationError::StopCount(items.len()));
    }
    if let Some(i) = items.iter().position(String::is_empty) {
        return Err(ValidationError::EmptyStop {
            param: format!("stop[{i}]"),
        });
    }
    Ok(items)
}

/// `{"<token id>": bias}`, keys in plain decimal, biases in [-100, 100];
/// returned in token order.
fn parse_logit_bias(entries: BTreeMap<String, f64>) -> Result<Vec<(u32, f32)>, ValidationError> {
    let mut bias = Vec::with_capacity(entries.len());
    for (key, value) in entries {
        // Plain decimal only, so that "7", "07" and "+7" cannot all name
        // token 7 in one object.
        let token = key
            .parse::<u32>()
            .ok()
            .filter(|id| id.to_string() == key)
            .ok_or_else(|| ValidationError::LogitBiasKey(key.clone()))?;
        if !(value.is_finite() && (-100.0..=100.0).contains(&value)) {
            return Err(ValidationError::LogitBiasOutOfRange { token, value });
        }
        bias.push((token, value as f32));
    }
    bias.sort_by_key(|&(token, _)| token);
    Ok(bias)
}

fn parse_stream(
    stream: bool,
    options: Option<request::StreamOptions>,
) -> Result<Option<StreamOptions>, ValidationError> {
    let Some(options) = options else {
        return Ok(stream.then(StreamOptions::default));
    };
    if !stream {
        return Err(ValidationError::StreamOptionsWithoutStream);
    }
    // `include_obfuscation` is accepted either way: chunks are never padded
    // (see `StreamOptions`).
    if options.continuous_usage_stats == Some(true) {
        return Err(ValidationError::UnsupportedParameter {
            param: "stream_options.continuous_usage_stats".into(),
        });
    }
    reject_unknown(options.unknown, &[], "stream_options.")?;
    Ok(Some(StreamOptions {
        include_usage: options.include_usage.unwrap_or(false),
    }))
}
