//! Chat templates (`tokenizer.chat_template`) rendered the way Hugging Face does.
//!
//! Hugging Face renders a chat template with Jinja2 in a sandbox with `trim_blocks`,
//! `lstrip_blocks` and the `loopcontrols` extension, passes `messages`, `add_generation_prompt`,
//! `bos_token`, `eos_token`, `tools` and `documents` (None unless given), and defines
//! `raise_exception(msg)`, `strftime_now(fmt)` and a `tojson` filter that behaves like Python's
//! `json.dumps(ensure_ascii=False)`. We do the same with MiniJinja, plus Python's string and
//! dict methods (`.strip()`, `.split()`, `.startswith()`, `.items()`, ...) from
//! `minijinja-contrib`'s pycompat layer.
//!
//! The template decides everything else, its default system prompt included: messages are
//! passed through as given.
//!
//! ```
//! use anygpu_models::chat_template::{ChatTemplate, Message};
//! let src = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}\
//!            {% if add_generation_prompt %}<|assistant|>{% endif %}";
//! let t = ChatTemplate::new(src).unwrap();
//! let s = t.render(&[Message::user("Hi")], true).unwrap();
//! assert_eq!(s, "<|user|>Hi\n<|assistant|>");
//! ```

use anygpu_core::{Error, Result};
use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{context, Environment, ErrorKind};
use serde::{Deserialize, Serialize};

use crate::tokenizer::LlmTokenizer;

/// The GGUF metadata key that holds the default chat template.
pub const CHAT_TEMPLATE_KEY: &str = "tokenizer.chat_template";

const TEMPLATE_NAME: &str = "chat_template";

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    /// "system", "user", "assistant" (or whatever the template knows, e.g. "tool").
    pub role: String,
    pub content: String,
}

impl Message {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Message { role: role.into(), content: content.into() }
    }
    pub fn system(content: impl Into<String>) -> Self {
        Message::new("system", content)
    }
    pub fn user(content: impl Into<String>) -> Self {
        Message::new("user", content)
    }
    pub fn assistant(content: impl Into<String>) -> Self {
        Message::new("assistant", content)
    }
}

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish_non_exhaustive()
    }
}

fn template_error(what: &str, e: minijinja::Error) -> Error {
    // `{:#}` adds the template line and context MiniJinja knows.
    let mut msg = format!("chat template: {what}: {e}");
    if let Some(detail) = e.detail() {
        if !msg.contains(detail) {
            msg.push_str(&format!(" ({detail})"));
        }
    }
    if let Some(line) = e.line() {
        msg.push_str(&format!(" [template line {line}]"));
    }
    Error::Format(msg)
}

impl ChatTemplate {
    /// Compiles `source`. `bos_token`/`eos_token` are empty until
    /// [`ChatTemplate::with_special_tokens`] or [`ChatTemplate::for_tokenizer`] sets them.
    pub fn new(source: &str) -> Result<ChatTemplate> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_keep_trailing_newline(false);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_template_owned(TEMPLATE_NAME, source.to_string()).map_err(|e| template_error("does not compile", e))?;
        Ok(ChatTemplate { env, bos_token: String::new(), eos_token: String::new() })
    }

    /// Compiles `source` with the BOS/EOS texts of a tokenizer (Hugging Face passes them as
    /// `bos_token`/`eos_token`).
    pub fn for_tokenizer(source: &str, tok: &LlmTokenizer) -> Result<ChatTemplate> {
        let text = |id: Option<u32>| id.and_then(|i| tok.token_text(i)).unwrap_or_default().to_string();
        Ok(ChatTemplate::new(source)?.with_special_tokens(text(tok.bos_id()), text(tok.eos_id())))
    }

    pub fn with_special_tokens(mut self, bos_token: impl Into<String>, eos_token: impl Into<String>) -> Self {
        self.bos_token = bos_token.into();
        self.eos_token = eos_token.into();
        self
    }

    /// The prompt for `messages`; with `add_generation_prompt` it ends where the assistant's
    /// reply begins.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        self.render_with(messages, add_generation_prompt, ())
    }

    /// [`ChatTemplate::render`] with more template variables (`tools`, `documents`,
    /// `enable_thinking`, ...): `extra` is anything that serializes to a map, and its keys win
    /// over the standard ones. Messages may be any serializable list (tool calls and all).
    pub fn render_with<M: Serialize + ?Sized, X: Serialize>(
        &self,
        messages: &M,
        add_generation_prompt: bool,
        extra: X,
    ) -> Result<String> {
        let tmpl = self.env.get_template(TEMPLATE_NAME).map_err(|e| template_error("missing", e))?;
        let extra = Value::from_serialize(&extra);
        let base = context! {
            messages => Value::from_serialize(messages),
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.as_str(),
            eos_token => self.eos_token.as_str(),
            tools => (),
            documents => (),
        };
        let ctx = if extra.kind() == ValueKind::Map {
            // Later maps win lookups.
            minijinja::value::merge_maps([base, extra])
        } else {
            base
        };
        tmpl.render(ctx).map_err(|e| template_error("rendering failed", e))
    }
}

fn raise_exception(msg: String) -> std::result::Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
}

/// `json.dumps(value, ensure_ascii=False, indent=indent, separators=separators,
/// sort_keys=sort_keys)`, as Hugging Face's `tojson` filter (no HTML escaping).
fn tojson(value: Value, indent: Option<Value>, kwargs: Kwargs) -> std::result::Result<Value, minijinja::Error> {
    let indent = match kwargs.get::<Option<Value>>("indent")?.or(indent) {
        None => None,
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) => match (v.as_i64(), v.as_str()) {
            (Some(n), _) => Some(" ".repeat(n.max(0) as usize)),
            (None, Some(s)) => Some(s.to_string()),
            _ => {
                return Err(minijinja::Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: indent must be an integer or a string",
                ))
            }
        },
    };
    let sort_keys = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
    let _ensure_ascii = kwargs.get::<Option<bool>>("ensure_ascii")?;
    let separators = kwargs.get::<Option<Vec<String>>>("separators")?;
    kwargs.assert_all_used()?;
    let (item_sep, key_sep) = match separators.as_deref() {
        Some([a, b]) => (a.clone(), b.clone()),
        Some(_) => {
            return Err(minijinja::Error::new(
                ErrorKind::InvalidOperation,
                "tojson: separators must be a pair of strings",
            ))
        }
        None if indent.is_some() => (",".to_string(), ": ".to_string()),
        None => (", ".to_string(), ": ".to_string()),
    };
    let opts = JsonOpts { indent, item_sep, key_sep, sort_keys };
    let mut out = String::new();
    write_json(&value, &opts, 0, &mut out)?;
    Ok(Value::from_safe_string(out))
}

struct JsonOpts {
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
}

fn write_json(v: &Value, o: &JsonOpts, depth: usize, out: &mut String) -> std::result::Result<(), minijinja::Error> {
    let newline = |out: &mut String, depth: usize| {
        if let Some(ind) = &o.indent {
            out.push('\n');
            for _ in 0..depth {
                out.push_str(ind);
            }
        }
    };
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            let s = v.to_string();
            // Python spells non-finite floats this way.
            out.push_str(match s.as_str() {
                "inf" => "Infinity",
                "-inf" => "-Infinity",
                "nan" | "NaN" => "NaN",
                _ => &s,
            });
        }
        ValueKind::String => {
            let s = v.as_str().unwrap_or_default();
            out.push_str(
                &serde_json::to_string(s)
                    .map_err(|e| minijinja::Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?,
            );
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = v.try_iter()?.collect();
            if o.sort_keys {
                keys.sort();
            }
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(&o.item_sep);
                }
                newline(out, depth + 1);
                let key = match k.as_str() {
                    Some(s) => s.to_string(),
                    None => k.to_string(),
                };
                out.push_str(&serde_json::to_string(&key).unwrap_or_else(|_| "\"\"".into()));
                out.push_str(&o.key_sep);
                write_json(&v.get_item(k)?, o, depth + 1, out)?;
            }
            newline(out, depth);
            out.push('}');
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&o.item_sep);
                }
                newline(out, depth + 1);
                write_json(item, o, depth + 1, out)?;
            }
            newline(out, depth);
            out.push(']');
        }
        _ => {
            return Err(minijinja::Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: cannot serialize a value of kind {}", v.kind()),
            ))
        }
    }
    Ok(())
}

/// Hugging Face's `strftime_now(format)`: the current date and time, here in UTC. Knows
/// `%Y %y %m %d %e %B %b %h %A %a %H %I %M %S %p %j %%` (and `%-d`, `%-m` without padding).
fn strftime_now(format: String) -> String {
    let secs =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs() as i64).unwrap_or(0);
    strftime(&format, secs)
}

fn strftime(format: &str, unix_secs: i64) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"];
    let days = unix_secs.div_euclid(86_400);
    let tod = unix_secs.rem_euclid(86_400);
    let (hour, minute, second) = (tod / 3600, tod % 3600 / 60, tod % 60);
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy_mar = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy_mar + 2) / 153;
    let day = doy_mar - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    const CUM: [i64; 12] = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = CUM[(month - 1) as usize] + day + i64::from(leap && month > 2);
    let weekday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday
    let m = (month - 1) as usize;

    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let mut spec = chars.next();
        let unpadded = spec == Some('-');
        if unpadded {
            spec = chars.next();
        }
        let num = |n: i64, width: usize| if unpadded { n.to_string() } else { format!("{n:0width$}") };
        match spec {
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&num(year % 100, 2)),
            Some('m') => out.push_str(&num(month, 2)),
            Some('d') => out.push_str(&num(day, 2)),
            Some('e') => out.push_str(&format!("{day:>2}")),
            Some('B') => out.push_str(MONTHS[m]),
            Some('b') | Some('h') => out.push_str(&MONTHS[m][..3]),
            Some('A') => out.push_str(DAYS[weekday]),
            Some('a') => out.push_str(&DAYS[weekday][..3]),
            Some('H') => out.push_str(&num(hour, 2)),
            Some('I') => out.push_str(&num(if hour % 12 == 0 { 12 } else { hour % 12 }, 2)),
            Some('M') => out.push_str(&num(minute, 2)),
            Some('S') => out.push_str(&num(second, 2)),
            Some('p') => out.push_str(if hour < 12 { "AM" } else { "PM" }),
            Some('j') => out.push_str(&num(yday, 3)),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strftime_known_dates() {
        // 2024-02-29 13:05:09 UTC, a Thursday.
        assert_eq!(strftime("%Y-%m-%d %H:%M:%S %a %j", 1_709_211_909), "2024-02-29 13:05:09 Thu 060");
        assert_eq!(strftime("%d %b %Y", 0), "01 Jan 1970");
        assert_eq!(strftime("%-d %B %y %I%p %%", 1_735_689_599), "31 December 24 11PM %");
    }

    #[test]
    fn tojson_is_python_json_dumps() {
        let t = ChatTemplate::new(
            "{{ x | tojson }}|{{ x | tojson(indent=2) }}|{{ {'b': 1, 'a': [1, 2.5, none, true]} | tojson(sort_keys=true) }}|{{ '<é\"\n' | tojson }}",
        )
        .unwrap();
        let s = t
            .render_with(&[] as &[Message], false, context! { x => context!{ k => "v", n => [] as [i32; 0] } })
            .unwrap();
        assert_eq!(
            s,
            "{\"k\": \"v\", \"n\": []}|{\n  \"k\": \"v\",\n  \"n\": []\n}|{\"a\": [1, 2.5, null, true], \"b\": 1}|\"<é\\\"\\n\""
        );
    }

    #[test]
    fn python_methods_and_raise_exception() {
        let t = ChatTemplate::new(
            "{% for m in messages %}{% if m.role not in ['user', 'assistant'] %}{{ raise_exception('bad role ' + m.role) }}{% endif %}{{ m.content.strip().upper() }}{% if m.content.startswith(' ') %}!{% endif %}\n{% endfor %}",
        )
        .unwrap();
        assert_eq!(t.render(&[Message::user(" hi ")], false).unwrap(), "HI!");
        let err = t.render(&[Message::system("x")], false).unwrap_err().to_string();
        assert!(err.contains("bad role system"), "{err}");
    }

    #[test]
    fn trim_and_lstrip_blocks_and_loop_controls() {
        let src = "{% for m in messages %}\n    {% if loop.index > 1 %}{% break %}{% endif %}\n{{ m.content }}\n{% endfor %}\n";
        let t = ChatTemplate::new(src).unwrap();
        assert_eq!(t.render(&[Message::user("a"), Message::user("b")], false).unwrap(), "a\n");
    }

    #[test]
    fn extra_variables_override_defaults() {
        let t = ChatTemplate::new("{{ tools is none }} {{ bos_token }}{{ flag }}")
            .unwrap()
            .with_special_tokens("<s>", "</s>");
        assert_eq!(t.render(&[], false).unwrap(), "True <s>");
        assert_eq!(
            t.render_with(&[] as &[Message], false, context! { tools => ["t"], flag => 1 }).unwrap(),
            "False <s>1"
        );
    }

    #[test]
    fn syntax_errors_are_format_errors() {
        let e = ChatTemplate::new("{% for m in messages %}").unwrap_err();
        assert!(matches!(e, Error::Format(_)), "{e}");
        assert!(e.to_string().contains("chat template"), "{e}");
    }
}
