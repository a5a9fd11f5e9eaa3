//! The fields `/v1/chat/completions` and `/v1/completions` share: sampling,
//! penalties, stop strings, logit bias, `n`, streaming, `user`,
//! `cache_prompt`.

use mlxcel_engine_api::{GenerationRequest, Prompt, SamplingParams};
use serde_json::{Map, Value};

use super::{
    boolean, integer, number, object, reject_leftovers, string, take, wrong_type, StreamOptions,
    ValidationError,
};

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
    pub ignore_eos: bool,
    pub min_tokens: usize,
}

impl SharedParams {
    /// Takes the shared fields out of `body`.
    pub fn parse(body: &mut Map<String, Value>) -> Result<Self, ValidationError> {
        let sampling = parse_sampling(body)?;
        let stop = match take(body, "stop") {
            Some(stop) => parse_stop(stop)?,
            None => Vec::new(),
        };
        let logit_bias = match take(body, "logit_bias") {
            Some(bias) => parse_logit_bias(bias)?,
            None => Vec::new(),
        };
        let n = match take(body, "n") {
            Some(n) => {
                let n = integer("n", n)?;
                if !(1..=MAX_N).contains(&n) {
                    return Err(ValidationError::NOutOfRange(n));
                }
                n as usize
            }
            None => 1,
        };
        let stream = parse_stream(body)?;
        let user = take(body, "user").map(|u| string("user", u)).transpose()?;
        let cache_prompt = match take(body, "cache_prompt") {
            Some(v) => boolean("cache_prompt", v)?,
            None => true,
        };
        let ignore_eos = match take(body, "ignore_eos") {
            Some(v) => boolean("ignore_eos", v)?,
            None => false,
        };
        let min_tokens = match take(body, "min_tokens") {
            Some(v) => {
                let value = integer("min_tokens", v)?;
                usize::try_from(value).map_err(|_| ValidationError::WrongType {
                    param: "min_tokens".into(),
                    expected: "a non-negative integer",
                })?
            }
            None => 0,
        };
        Ok(Self {
            sampling,
            stop,
            logit_bias,
            n,
            stream,
            user,
            cache_prompt,
            ignore_eos,
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
            ignore_eos: self.ignore_eos,
            min_tokens: self.min_tokens,
            ..GenerationRequest::new(prompt, self.sampling, max_tokens)
        }
    }
}

/// `param` as a token budget of at least 1, saturating at `usize::MAX`.
pub(super) fn max_tokens(param: &'static str, value: Value) -> Result<usize, ValidationError> {
    let value = integer(param, value)?;
    if value < 1 {
        return Err(ValidationError::MaxTokensTooSmall { param, value });
    }
    Ok(usize::try_from(value).unwrap_or(usize::MAX))
}

fn parse_sampling(body: &mut Map<String, Value>) -> Result<SamplingParams, ValidationError> {
    let mut sampling = SamplingParams::default();
    if let Some(value) = take(body, "temperature") {
        let t = number("temperature", value)?;
        if !(t.is_finite() && (0.0..=2.0).contains(&t)) {
            return Err(ValidationError::TemperatureOutOfRange(t));
        }
        sampling.temperature = t as f32;
    }
    if let Some(value) = take(body, "top_p") {
        let p = number("top_p", value)?;
        if !(p.is_finite() && p > 0.0 && p <= 1.0) {
            return Err(ValidationError::TopPOutOfRange(p));
        }
        sampling.top_p = p as f32;
    }
    if let Some(value) = take(body, "top_k") {
        let k = integer("top_k", value)?;
        if k < 0 {
            return Err(ValidationError::TopKNegative(k));
        }
        sampling.top_k = usize::try_from(k).unwrap_or(usize::MAX);
    }
    if let Some(value) = take(body, "min_p") {
        let p = number("min_p", value)?;
        if !(p.is_finite() && (0.0..=1.0).contains(&p)) {
            return Err(ValidationError::MinPOutOfRange(p));
        }
        sampling.min_p = p as f32;
    }
    if let Some(value) = take(body, "seed") {
        let seed = integer("seed", value)?;
        // Negative seeds map to their two's-complement bits: distinct seeds
        // stay distinct and the mapping is stable.
        sampling.seed = Some(u64::try_from(seed).unwrap_or(seed as i64 as u64));
    }
    for param in ["presence_penalty", "frequency_penalty"] {
        let Some(value) = take(body, param) else {
            continue;
        };
        let value = number(param, value)?;
        if !(value.is_finite() && (-2.0..=2.0).contains(&value)) {
            return Err(ValidationError::PenaltyOutOfRange { param, value });
        }
        if param == "presence_penalty" {
            sampling.presence_penalty = value as f32;
        } else {
            sampling.frequency_penalty = value as f32;
        }
    }
    if let Some(value) = take(body, "repetition_penalty") {
        let r = number("repetition_penalty", value)?;
        if !(r.is_finite() && r > 0.0 && r <= 2.0) {
            return Err(ValidationError::RepetitionPenaltyOutOfRange(r));
        }
        sampling.repetition_penalty = r as f32;
    }
    Ok(sampling)
}

/// A string, or an array of up to 4 strings (`[]`: none, as `null`); none
/// may be empty.
fn parse_stop(value: Value) -> Result<Vec<String>, ValidationError> {
    let items = match value {
        Value::String(stop) if stop.is_empty() => {
            return Err(ValidationError::EmptyStop {
                param: "stop".to_owned(),
            })
        }
        Value::String(stop) => return Ok(vec![stop]),
        Value::Array(items) => items,
        _ => return Err(wrong_type("stop", "a string or an array of strings")),
    };
    if items.len() > MAX_STOP {
        return Err(ValidationError::StopCount(items.len()));
    }
    items
        .into_iter()
        .enumerate()
        .map(|(i, item)| {
            let param = format!("stop[{i}]");
            let stop = string(&param, item)?;
            if stop.is_empty() {
                return Err(ValidationError::EmptyStop { param });
            }
            Ok(stop)
        })
        .collect()
}

/// `{"<token id>": bias}`, keys in plain decimal, biases in [-100, 100];
/// returned in token order.
fn parse_logit_bias(value: Value) -> Result<Vec<(u32, f32)>, ValidationError> {
    let entries = object("logit_bias", value)?;
    let mut bias = Vec::with_capacity(entries.len());
    for (key, value) in entries {
        // Plain decimal only, so that "7", "07" and "+7" cannot all name
        // token 7 in one object.
        let token = key
            .parse::<u32>()
            .ok()
            .filter(|id| id.to_string() == key)
            .ok_or_else(|| ValidationError::LogitBiasKey(key.clone()))?;
        let value = number(&format!("logit_bias.{key}"), value)?;
        if !(value.is_finite() && (-100.0..=100.0).contains(&value)) {
            return Err(ValidationError::LogitBiasOutOfRange { token, value });
        }
        bias.push((token, value as f32));
    }
    bias.sort_by_key(|&(token, _)| token);
    Ok(bias)
}

fn parse_stream(body: &mut Map<String, Value>) -> Result<Option<StreamOptions>, ValidationError> {
    let stream = match take(body, "stream") {
        Some(value) => boolean("stream", value)?,
        None => false,
    };
    let Some(options) = take(body, "stream_options") else {
        return Ok(stream.then(StreamOptions::default));
    };
    if !stream {
        return Err(ValidationError::StreamOptionsWithoutStream);
    }
    let mut options = object("stream_options", options)?;
    let include_usage = match take(&mut options, "include_usage") {
        Some(value) => boolean("stream_options.include_usage", value)?,
        None => false,
    };
    // Never padded, whatever the client prefers (see `StreamOptions`).
    if let Some(value) = take(&mut options, "include_obfuscation") {
        boolean("stream_options.include_obfuscation", value)?;
    }
    if let Some(value) = take(&mut options, "continuous_usage_stats") {
        if boolean("stream_options.continuous_usage_stats", value)? {
            return Err(ValidationError::UnsupportedParameter {
                param: "stream_options.continuous_usage_stats".into(),
            });
        }
    }
    reject_leftovers(options, &[], "stream_options.")?;
    Ok(Some(StreamOptions { include_usage }))
}
