//! Gemma 4's tool calls as a Lark grammar (llguidance dialect), for
//! [`super::Grammar::Gemma4Calls`].
//!
//! A call is `<|tool_call>call:NAME{ARGS}<tool_call|>`, ARGS written in
//! Gemma 4's notation ([`crate::output::tool_calls::gemma4`]): keys bare,
//! strings between two `<|"|>` markers, everything else bare. The
//! arguments' JSON Schema is translated into rules of that notation, with
//! no whitespace anywhere:
//!
//! - `object` with `properties`: the keys in the schema's order, each
//!   `key:VALUE`, separated by `,`; a `required` key always, any other key
//!   present or left out (so the keys written are always in the schema's
//!   order). Keys the schema does not list are never written, whatever
//!   `additionalProperties` says. An object without `properties` is `{}`
//!   under `additionalProperties: false`, keys of the generic form with
//!   values of its `additionalProperties` schema when that is one, else
//!   the generic object. A key that is not a plain word (it holds
//!   whitespace or `:,{}[]<>"`) is written as a `<|"|>` string.
//! - `string`: `<|"|>`, text without the marker `<|"|>`, `<|"|>`, within
//!   `minLength` and `maxLength` (characters); `pattern` and `format` are
//!   not enforced.
//! - `integer`, `number` (JSON's spellings; bounds not enforced),
//!   `boolean`, `null`; a list of types as alternatives.
//! - `array`: `[V,V,..]` of its `items` (any values without one), at least
//!   one item under `minItems` ≥ 1 (other bounds not enforced).
//! - `enum` and `const`: their values written in the notation, as
//!   alternatives (a string holding `<|"|>` cannot be written and is left
//!   out).
//! - `anyOf` and `oneOf`: alternatives; `allOf` of one schema: that one.
//! - Anything else (no type and no hint of one, `$ref`, `allOf` of
//!   several, unknown types), and schemas nested deeper than
//!   [`MAX_DEPTH`]: the generic value, any object, array, string, number,
//!   boolean or null of the notation, with keys `[A-Za-z_][A-Za-z0-9_]*`.
//!
//! Each marker is the tokenizer's special token when it has one (`<[id]>`
//! items, as Gemma 4's tokenizer writes them; the text between two quote
//! tokens then excludes the spelled-out `<|"|>`, which the output parser
//! would read as the string's end), else its text.

use serde_json::Value as Json;

use super::ConstraintError;
use crate::output::tool_calls::gemma4::{GEMMA4_CALL_CLOSE, GEMMA4_CALL_OPEN, GEMMA4_QUOTE};

/// Schemas nested deeper than this are the generic value.
const MAX_DEPTH: usize = 12;

/// A Lark string literal of `s`.
fn lit(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_default()
}

/// The Lark grammar of Gemma 4 calls of `tools` (see the module docs and
/// [`super::Grammar::Gemma4Calls`]). `named`: the prompt already holds
/// `<|tool_call>call:NAME{` for the one tool, so the grammar is its
/// arguments' members, `}` and `<tool_call|>`; else it continues
/// `<|tool_call>call:` with one of the names, `{`, the arguments, `}` and
/// `<tool_call|>`, and (unless `single`) `<|tool_call>call:` and another
/// call, any number of times. `markers`: the ids of `<|tool_call>`,
/// `<tool_call|>` and `<|"|>` as special tokens, each `None` where the
/// tokenizer has it as text.
///
/// Errors: [`ConstraintError::InvalidGrammar`] without tools, with several
/// tools when `named`, or for a key that holds `<|"|>`.
pub(super) fn gemma4_calls_lark(
    tools: &[(String, Json)],
    named: bool,
    single: bool,
    markers: [Option<u32>; 3],
) -> Result<String, ConstraintError> {
    if tools.is_empty() || (named && tools.len() != 1) {
        return Err(ConstraintError::InvalidGrammar(
            "Gemma 4 tool calls need one named tool or at least one tool".into(),
        ));
    }
    let marker = |id: Option<u32>, text: &str| match id {
        Some(id) => format!("<[{id}]>"),
        None => lit(text),
    };
    let (open, close) = (
        marker(markers[0], GEMMA4_CALL_OPEN),
        marker(markers[1], GEMMA4_CALL_CLOSE),
    );
    let mut lark = Lark {
        rules: String::new(),
        next: 0,
        quote: markers[2].map(|quote| format!("<[{quote}]>")),
        generic: false,
    };
    let mut head = String::new();
    if named {
        let body = lark.members(&tools[0].1, 0)?;
        head.push_str(&format!("start: {} \"}}\" {close}\n", body.optional()));
    } else {
        head.push_str(&if single {
            format!("start: call {close}\n")
        } else {
            format!("start: call ({close} {open} \"call:\" call)* {close}\n")
        });
        let alts: Vec<String> = (0..tools.len()).map(|i| format!("call_{i}")).collect();
        head.push_str(&format!("call: {}\n", alts.join(" | ")));
        for (i, (name, params)) in tools.iter().enumerate() {
            let body = lark.members(params, 0)?;
            head.push_str(&format!(
                "call_{i}: {} {} \"}}\"\n",
                lit(&format!("{name}{{")),
                body.optional()
            ));
        }
    }
    head.push_str("NO_QUOTE: ~/(?s:.*)<\\|\"\\|>(?s:.*)/\n");
    head.push_str("INT: /-?(0|[1-9][0-9]*)/\n");
    head.push_str("NUM: /-?(0|[1-9][0-9]*)(\\.[0-9]+)?([eE][+-]?[0-9]+)?/\n");
    if lark.generic {
        lark.generic_rules();
    }
    Ok(head + &lark.rules)
}

/// An object's members as a rule: its name and whether it may be empty;
/// `None` when nothing may be inside the braces.
struct Members {
    rule: Option<(String, bool)>,
}

impl Members {
    /// The rule as an item: `rule?` when it may be empty, nothing when
    /// there are no members.
    fn optional(&self) -> String {
        match &self.rule {
            Some((rule, true)) => format!("{rule}?"),
            Some((rule, false)) => rule.clone(),
            None => String::new(),
        }
    }
}

/// The rules being written.
struct Lark {
    rules: String,
    /// The next rule number.
    next: usize,
    /// The `<[id]>` of the quote token, or `None` (the quote is text).
    quote: Option<String>,
    /// The generic value is used: its rules are written at the end.
    generic: bool,
}

impl Lark {
    /// A fresh rule (or terminal, `upper`) name.
    fn name(&mut self, upper: bool) -> String {
        self.next += 1;
        match upper {
            true => format!("T{}", self.next),
            false => format!("r{}", self.next),
        }
    }

    fn rule(&mut self, body: &str) -> String {
        let name = self.name(false);
        self.rules.push_str(&format!("{name}: {body}\n"));
        name
    }

    /// The generic value.
    fn generic(&mut self) -> String {
        self.generic = true;
        "g_value".into()
    }

    /// Writes the generic value's rules.
    fn generic_rules(&mut self) {
        let string = self.string(0, None);
        self.rules.push_str(&format!(
            "g_value: {string} | NUM | \"true\" | \"false\" | \"null\" | g_object | g_array\n\
             g_object: \"{{\" g_members? \"}}\"\n\
             g_members: g_member (\",\" g_member)*\n\
             g_member: GKEY \":\" g_value\n\
             g_array: \"[\" (g_value (\",\" g_value)*)? \"]\"\n\
             GKEY: /[A-Za-z_][A-Za-z0-9_]*/\n"
        ));
    }

    /// A string of `min` to `max` characters (no `<|"|>` inside).
    fn string(&mut self, min: u64, max: Option<u64>) -> String {
        let length = |min: u64| match max {
            Some(max) => format!("{{{min},{max}}}"),
            None => format!("{{{min},}}"),
        };
        match self.quote.clone() {
            None => {
                let terminal = self.name(true);
                self.rules.push_str(&format!(
                    "{terminal}: {q} (/(?s:.{})/ & NO_QUOTE) {q}\n",
                    length(min),
                    q = lit(GEMMA4_QUOTE)
                ));
                terminal
            }
            Some(q) if max == Some(0) => format!("{q} {q}"),
            Some(q) => {
                // The text between the quote tokens is a lexeme that
                // cannot be empty: an empty string is the two tokens alone.
                let terminal = self.name(true);
                self.rules.push_str(&format!(
                    "{terminal}: /(?s:.{})/ & NO_QUOTE\n",
                    length(min.max(1))
                ));
                match min {
                    0 => format!("({q} {q} | {q} {terminal} {q})"),
                    _ => format!("{q} {terminal} {q}"),
                }
            }
        }
    }

    /// `s` as a string of the notation, or `None` when it holds `<|"|>`.
    fn string_literal(&self, s: &str) -> Option<String> {
        if s.contains(GEMMA4_QUOTE) {
            return None;
        }
        Some(match &self.quote {
            None => lit(&format!("{GEMMA4_QUOTE}{s}{GEMMA4_QUOTE}")),
            Some(q) if s.is_empty() => format!("{q} {q}"),
            Some(q) => format!("{q} {} {q}", lit(s)),
        })
    }

    /// `key:` as items: the key bare when it is a plain word, else a string.
    fn key(&self, key: &str) -> Result<String, ConstraintError> {
        let plain = !key.is_empty()
            && !key
                .chars()
                .any(|c| c.is_whitespace() || ":,{}[]<>\"".contains(c));
        if plain {
            return Ok(lit(&format!("{key}:")));
        }
        let quoted = self.string_literal(key).ok_or_else(|| {
            ConstraintError::InvalidGrammar(format!("a key holds {GEMMA4_QUOTE}: {key:?}"))
        })?;
        Ok(format!("{quoted} \":\""))
    }

    /// A JSON value written in the notation, as items (`None` when a
    /// string in it holds `<|"|>`).
    fn literal(&self, value: &Json) -> Option<String> {
        Some(match value {
            Json::String(s) => self.string_literal(s)?,
            Json::Array(items) => {
                let items: Option<Vec<String>> = items.iter().map(|v| self.literal(v)).collect();
                format!("\"[\" {} \"]\"", items?.join(" \",\" "))
            }
            Json::Object(map) => {
                let members: Option<Vec<String>> = map
                    .iter()
                    .map(|(k, v)| Some(format!("{} {}", self.key(k).ok()?, self.literal(v)?)))
                    .collect();
                format!("\"{{\" {} \"}}\"", members?.join(" \",\" "))
            }
            other => lit(&other.to_string()),
        })
    }

    /// The rule items of a value valid against `schema`.
    fn value(&mut self, schema: &Json, depth: usize) -> Result<String, ConstraintError> {
        let Json::Object(map) = schema else {
            return Ok(self.generic());
        };
        if depth > MAX_DEPTH || map.contains_key("$ref") {
            return Ok(self.generic());
        }
        if let Some(value) = map.get("const") {
            return match self.literal(value) {
                Some(items) => Ok(format!("({items})")),
                None => Err(ConstraintError::InvalidGrammar(format!(
                    "a const cannot be written in Gemma 4's notation: {value}"
                ))),
            };
        }
        if let Some(values) = map.get("enum").and_then(Json::as_array) {
            let alts: Vec<String> = values.iter().filter_map(|v| self.literal(v)).collect();
            if alts.is_empty() {
                return Err(ConstraintError::InvalidGrammar(
                    "an enum with no value Gemma 4's notation can write".into(),
                ));
            }
            return Ok(format!("({})", alts.join(" | ")));
        }
        for key in ["anyOf", "oneOf"] {
            if let Some(Json::Array(schemas)) = map.get(key) {
                if schemas.is_empty() {
                    return Ok(self.generic());
                }
                let alts = schemas
                    .iter()
                    .map(|s| self.value(s, depth + 1))
                    .collect::<Result<Vec<_>, _>>()?;
                return Ok(format!("({})", alts.join(" | ")));
            }
        }
        if let Some(Json::Array(schemas)) = map.get("allOf") {
            return match schemas.as_slice() {
                [one] => self.value(one, depth + 1),
                _ => Ok(self.generic()),
            };
        }
        match map.get("type") {
            Some(Json::String(ty)) => self.typed(ty, schema, depth),
            Some(Json::Array(types)) => {
                let alts = types
                    .iter()
                    .map(|t| match t.as_str() {
                        Some(ty) => self.typed(ty, schema, depth),
                        None => Ok(self.generic()),
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                if alts.is_empty() {
                    return Ok(self.generic());
                }
                Ok(format!("({})", alts.join(" | ")))
            }
            _ if map.contains_key("properties") => self.typed("object", schema, depth),
            _ if map.contains_key("items") => self.typed("array", schema, depth),
            _ => Ok(self.generic()),
        }
    }

    /// A value of JSON type `ty` valid against `schema`.
    fn typed(&mut self, ty: &str, schema: &Json, depth: usize) -> Result<String, ConstraintError> {
        let bound = |k: &str| schema.get(k).and_then(Json::as_u64);
        Ok(match ty {
            "string" => self.string(bound("minLength").unwrap_or(0), bound("maxLength")),
            "integer" => "INT".into(),
            "number" => "NUM".into(),
            "boolean" => "(\"true\" | \"false\")".into(),
            "null" => "\"null\"".into(),
            "object" => {
                let members = self.members(schema, depth)?;
                self.rule(&format!("\"{{\" {} \"}}\"", members.optional()))
            }
            "array" => {
                let item = match schema.get("items") {
                    Some(items @ Json::Object(_)) => self.value(items, depth + 1)?,
                    _ => self.generic(),
                };
                let list = format!("{item} (\",\" {item})*");
                match bound("minItems").unwrap_or(0) {
                    0 => self.rule(&format!("\"[\" ({list})? \"]\"")),
                    _ => self.rule(&format!("\"[\" {list} \"]\"")),
                }
            }
            _ => self.generic(),
        })
    }

    /// The members of an object valid against `schema` (inside its
    /// braces; see the module docs).
    fn members(&mut self, schema: &Json, depth: usize) -> Result<Members, ConstraintError> {
        let properties = schema.get("properties").and_then(Json::as_object);
        let Some(properties) = properties.filter(|p| !p.is_empty()) else {
            let body = match schema.get("additionalProperties") {
                // Nothing may be inside.
                Some(Json::Bool(false)) => return Ok(Members { rule: None }),
                Some(values @ Json::Object(_)) => {
                    let value = self.value(values, depth + 1)?;
                    let member = self.rule(&format!("GKEY \":\" {value}"));
                    self.generic = true;
                    format!("{member} (\",\" {member})*")
                }
                _ => {
                    self.generic = true;
                    "g_members".into()
                }
            };
            return Ok(Members {
                rule: Some((self.rule(&body), true)),
            });
        };
        let required: Vec<&str> = schema
            .get("required")
            .and_then(Json::as_array)
            .map(|r| r.iter().filter_map(Json::as_str).collect())
            .unwrap_or_default();
        let mut members = Vec::new();
        for (key, value) in properties {
            let key_items = self.key(key)?;
            let value = self.value(value, depth + 1)?;
            let rule = self.rule(&format!("{key_items} {value}"));
            members.push((rule, required.contains(&key.as_str())));
        }
        // `more[k]`: the members from k on after one was written, each
        // with its `,`.
        let mut more = vec![String::new(); members.len() + 1];
        for (k, (rule, required)) in members.iter().enumerate().rev() {
            let item = match required {
                true => format!("\",\" {rule}"),
                false => format!("(\",\" {rule})?"),
            };
            more[k] = format!("{item} {}", more[k + 1]);
        }
        // The first member written is any optional one before the first
        // required one, or that one; none when nothing is required.
        let mut alts = Vec::new();
        let mut empty = true;
        for (k, (rule, required)) in members.iter().enumerate() {
            alts.push(format!("{rule} {}", more[k + 1]).trim_end().to_owned());
            if *required {
                empty = false;
                break;
            }
        }
        Ok(Members {
            rule: Some((self.rule(&alts.join(" | ")), empty)),
        })
    }
}
