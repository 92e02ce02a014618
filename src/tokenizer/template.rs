//! Chat templates: renders a conversation into the prompt text a chat model was trained on, with the
//! Jinja template the checkpoint ships (`tokenizer.chat_template` in a GGUF, `chat_template` in
//! tokenizer_config.json or chat_template.jinja in an HF folder).
//!
//! Hub templates are written for Python's jinja2 as set up by `transformers`
//! (`apply_chat_template`): `trim_blocks` and `lstrip_blocks` on, `keep_trailing_newline` off (the
//! jinja2 default), `raise_exception`, `strftime_now` and a `tojson` that does not HTML-escape. We
//! mirror that environment with minijinja, and use minijinja-contrib's pycompat callback for the
//! Python string/dict methods templates call (`.strip()`, `.startswith()`, `.split()`, `.items()`).

use anyhow::{anyhow, Result};
use minijinja::value::{Kwargs, ValueKind};
use minijinja::{context, AutoEscape, Environment, Error, ErrorKind, Value};
use serde::{Deserialize, Serialize};

/// One turn of a conversation, as chat templates read it (`message['role']`, `message['content']`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: String,
}

impl Message {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }
}

const TEMPLATE_NAME: &str = "chat_template";

/// A compiled chat template.
pub(crate) struct ChatTemplate {
    env: Environment<'static>,
    /// A template minijinja cannot compile is kept as an error to report when it is used, so a
    /// checkpoint with an exotic template still loads (and runs with --no-chat-template).
    compile_error: Option<String>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("compile_error", &self.compile_error)
            .finish_non_exhaustive()
    }
}

impl ChatTemplate {
    pub(crate) fn new(source: String) -> Self {
        let mut env = Environment::new();
        // Syntax settings must be in place before the template is compiled.
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_keep_trailing_newline(false);
        env.set_auto_escape_callback(|_| AutoEscape::None);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        let compile_error = env
            .add_template_owned(TEMPLATE_NAME, source)
            .err()
            .map(|e| format!("{e:#}"));
        Self { env, compile_error }
    }

    /// Why the template could not be compiled, if it could not.
    pub(crate) fn compile_error(&self) -> Option<&str> {
        self.compile_error.as_deref()
    }

    /// Renders `messages` with `bos_token`/`eos_token` defined, no tools, and the template's own
    /// variables `vars` (checked by [`check_template_vars`]), as transformers' `apply_chat_template(...,
    /// **kwargs)`.
    pub(crate) fn render(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
        bos_token: &str,
        eos_token: &str,
        vars: &TemplateVars,
    ) -> Result<String> {
        if let Some(e) = &self.compile_error {
            return Err(anyhow!(
                "the model's chat template cannot be compiled ({e}); run with --no-chat-template \
                 and write the prompt yourself"
            ));
        }
        let tmpl = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| anyhow!("chat template: {e:#}"))?;
        let ctx = context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => bos_token,
            eos_token => eos_token,
            tools => Value::from(()),
            ..Value::from_serialize(vars)
        };
        tmpl.render(ctx)
            .map_err(|e| anyhow!("rendering the chat template failed: {e:#}"))
    }
}

/// Variables a chat template reads beyond the conversation, by name (e.g. Qwen 3's `enable_thinking`).
pub type TemplateVars = serde_json::Map<String, serde_json::Value>;

/// The names the renderer sets itself, which a template variable may not replace.
const RESERVED_VARS: [&str; 5] = [
    "messages",
    "add_generation_prompt",
    "bos_token",
    "eos_token",
    "tools",
];

/// Template variables from JSON text: an object, none of whose names the renderer sets itself.
pub fn parse_template_vars(json: &str) -> Result<TemplateVars> {
    let value: serde_json::Value = serde_json::from_str(json)
        .map_err(|e| anyhow!("not JSON ({e}); give an object, e.g. '{{\"enable_thinking\": false}}'"))?;
    let serde_json::Value::Object(vars) = value else {
        return Err(anyhow!(
            "a JSON object of template variables, e.g. '{{\"enable_thinking\": false}}', not {value}"
        ));
    };
    check_template_vars(&vars)?;
    Ok(vars)
}

/// Fails on a variable the renderer sets itself (the conversation, the generation prompt, the special
/// tokens, the tools).
pub fn check_template_vars(vars: &TemplateVars) -> Result<()> {
    match vars.keys().find(|k| RESERVED_VARS.contains(&k.as_str())) {
        Some(k) => Err(anyhow!(
            "'{k}' is set by probespec itself, not a template variable (reserved: {})",
            RESERVED_VARS.join(", ")
        )),
        None => Ok(()),
    }
}

/// `raise_exception(msg)`: templates call it to reject a conversation (e.g. roles out of order).
fn raise_exception(msg: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg))
}

/// `strftime_now(fmt)`: the current date/time (UTC), formatted with the common strftime
/// directives (LLaMA 3.2's template puts "%d %b %Y" in its system prompt).
fn strftime_now(fmt: String) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    strftime(&fmt, secs)
}

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
const WEEKDAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

/// Formats a Unix time (UTC) like C's strftime, for the directives chat templates use.
fn strftime(fmt: &str, unix_secs: i64) -> String {
    let days = unix_secs.div_euclid(86_400);
    let secs_of_day = unix_secs.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    let (hour, minute, second) = (secs_of_day / 3600, secs_of_day / 60 % 60, secs_of_day % 60);
    // 1970-01-01 was a Thursday (index 3 with Monday = 0).
    let weekday = (days + 3).rem_euclid(7) as usize;
    let day_of_year = days - days_from_civil(year, 1, 1) + 1;
    let month_name = MONTHS[(month - 1) as usize];
    let mut out = String::with_capacity(fmt.len() + 16);
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year.rem_euclid(100))),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('e') => out.push_str(&format!("{day:>2}")),
            Some('j') => out.push_str(&format!("{day_of_year:03}")),
            Some('b') | Some('h') => out.push_str(&month_name[..3]),
            Some('B') => out.push_str(month_name),
            Some('a') => out.push_str(&WEEKDAYS[weekday][..3]),
            Some('A') => out.push_str(WEEKDAYS[weekday]),
            Some('H') => out.push_str(&format!("{hour:02}")),
            Some('I') => out.push_str(&format!("{:02}", (hour + 11) % 12 + 1)),
            Some('p') => out.push_str(if hour < 12 { "AM" } else { "PM" }),
            Some('M') => out.push_str(&format!("{minute:02}")),
            Some('S') => out.push_str(&format!("{second:02}")),
            Some('F') => out.push_str(&format!("{year}-{month:02}-{day:02}")),
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

/// Days since 1970-01-01 to (year, month, day) in the proleptic Gregorian calendar
/// (Howard Hinnant's algorithm).
pub(crate) fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// The inverse of [`civil_from_days`].
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = if month > 2 { month - 3 } else { month + 9 };
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// `tojson` as transformers defines it: Python's `json.dumps` (no HTML escaping, `ensure_ascii`
/// off by default, `indent`, `separators` and `sort_keys` honoured). minijinja's own filter
/// escapes `<`, `>`, `&` and `'`, which would change tool schemas in prompts.
fn tojson(value: Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<Value> = kwargs.get("indent")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => Some(match v.as_str() {
            Some(s) => s.to_string(),
            None => " ".repeat(usize::try_from(v)?),
        }),
    };
    let (item_sep, key_sep) = match separators {
        Some(seps) if seps.len() == 2 => (seps[0].clone(), seps[1].clone()),
        Some(_) => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "tojson: separators must be a pair",
            ))
        }
        None if indent.is_some() => (",".to_string(), ": ".to_string()),
        None => (", ".to_string(), ": ".to_string()),
    };
    let opts = JsonOpts {
        indent,
        ensure_ascii: ensure_ascii.unwrap_or(false),
        sort_keys: sort_keys.unwrap_or(false),
        item_sep,
        key_sep,
    };
    let mut out = String::new();
    write_json(&value, &opts, 0, &mut out)?;
    Ok(Value::from_safe_string(out))
}

struct JsonOpts {
    indent: Option<String>,
    ensure_ascii: bool,
    sort_keys: bool,
    item_sep: String,
    key_sep: String,
}

fn write_json(v: &Value, opts: &JsonOpts, level: usize, out: &mut String) -> Result<(), Error> {
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if let Some(i) = v.as_i64() {
                out.push_str(&i.to_string());
            } else {
                let f = f64::try_from(v.clone())?;
                out.push_str(&python_float(f));
            }
        }
        ValueKind::String => write_json_str(v.as_str().unwrap_or_default(), opts, out),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            write_container(('[', ']'), items.len(), opts, level, out, |i, out| {
                write_json(&items[i], opts, level + 1, out)
            })?;
        }
        ValueKind::Map => {
            let mut entries: Vec<(String, Value)> = v
                .try_iter()?
                .map(|k| {
                    let val = v.get_item(&k).unwrap_or_default();
                    let key = match k.as_str() {
                        Some(s) => s.to_string(),
                        None => k.to_string(),
                    };
                    (key, val)
                })
                .collect();
            if opts.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(&b.0));
            }
            write_container(('{', '}'), entries.len(), opts, level, out, |i, out| {
                write_json_str(&entries[i].0, opts, out);
                out.push_str(&opts.key_sep);
                write_json(&entries[i].1, opts, level + 1, out)
            })?;
        }
        _ => write_json_str(&v.to_string(), opts, out),
    }
    Ok(())
}

fn write_container(
    (open, close): (char, char),
    len: usize,
    opts: &JsonOpts,
    level: usize,
    out: &mut String,
    mut item: impl FnMut(usize, &mut String) -> Result<(), Error>,
) -> Result<(), Error> {
    out.push(open);
    if len == 0 {
        out.push(close);
        return Ok(());
    }
    for i in 0..len {
        if i > 0 {
            out.push_str(&opts.item_sep);
        }
        if let Some(ind) = &opts.indent {
            out.push('\n');
            out.push_str(&ind.repeat(level + 1));
        }
        item(i, out)?;
    }
    if let Some(ind) = &opts.indent {
        out.push('\n');
        out.push_str(&ind.repeat(level));
    }
    out.push(close);
    Ok(())
}

fn write_json_str(s: &str, opts: &JsonOpts, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (opts.ensure_ascii && !c.is_ascii()) => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python's `repr(float)` for the values that show up in templates.
fn python_float(f: f64) -> String {
    if f.is_nan() {
        "NaN".to_string()
    } else if f.is_infinite() {
        if f > 0.0 { "Infinity" } else { "-Infinity" }.to_string()
    } else if f.fract() == 0.0 && f.abs() < 1e16 {
        format!("{f:.1}")
    } else {
        format!("{f}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(src: &str, messages: &[Message], gen: bool) -> Result<String> {
        ChatTemplate::new(src.to_string()).render(messages, gen, "<s>", "</s>", &TemplateVars::new())
    }

    #[test]
    fn trim_and_lstrip_blocks_like_hf() {
        let src = "{% for m in messages %}\n  {% if m.role %}{{ m.role }}: {{ m.content }}\n  {% endif %}\n{% endfor %}\n{% if add_generation_prompt %}\nA:{% endif %}\n";
        let msgs = [Message::new("user", "hi"), Message::new("assistant", "yo")];
        assert_eq!(render(src, &msgs, true).unwrap(), "user: hi\nassistant: yo\nA:");
        assert_eq!(render(src, &msgs, false).unwrap(), "user: hi\nassistant: yo\n");
    }

    #[test]
    fn python_methods_and_special_tokens() {
        let src = "{{ bos_token }}{% for m in messages %}{{ m['content'].strip().split(' ')[0].upper() }}\
                   {% if m.content.startswith(' x') %}!{% endif %}{% endfor %}{{ eos_token }}\
                   {% if tools is none %}N{% endif %}";
        let msgs = [Message::new("user", " xyz abc ")];
        assert_eq!(render(src, &msgs, false).unwrap(), "<s>XYZ!</s>N");
    }

    #[test]
    fn raise_exception_surfaces_message() {
        let src =
            "{% if messages[0].role != 'system' %}{{ raise_exception('need a system turn') }}{% endif %}";
        let err = render(src, &[Message::new("user", "x")], false)
            .unwrap_err()
            .to_string();
        assert!(err.contains("need a system turn"), "{err}");
    }

    #[test]
    fn broken_template_fails_only_when_used() {
        let t = ChatTemplate::new("{% for %}".to_string());
        let err = t
            .render(&[], false, "", "", &TemplateVars::new())
            .unwrap_err()
            .to_string();
        assert!(err.contains("--no-chat-template"), "{err}");
    }

    #[test]
    fn tojson_matches_python_json_dumps() {
        let src = r#"{{ {"b": [1, 2.5, "<é>"], "a": none} | tojson }}|{{ [1, {"k": true}] | tojson(indent=2) }}|{{ "é" | tojson(ensure_ascii=true) }}"#;
        let out = render(src, &[], false).unwrap();
        // minijinja maps are ordered by key unless `preserve_order` is on; both keys orders are
        // acceptable here, the formatting is what matters.
        let first = out.split('|').next().unwrap();
        assert!(
            first == r#"{"b": [1, 2.5, "<é>"], "a": null}"#
                || first == r#"{"a": null, "b": [1, 2.5, "<é>"]}"#,
            "{first}"
        );
        assert!(out.contains("|[\n  1,\n  {\n    \"k\": true\n  }\n]|"), "{out}");
        assert!(out.ends_with(r#"|"\u00e9""#), "{out}");
    }

    #[test]
    fn strftime_known_dates() {
        // 2024-07-26 00:00:00 UTC (a Friday), LLaMA 3.1's default date.
        let t = 1_721_952_000;
        assert_eq!(strftime("%d %b %Y", t), "26 Jul 2024");
        assert_eq!(
            strftime("%A %B %e %j %H:%M:%S %%", t),
            "Friday July 26 208 00:00:00 %"
        );
        assert_eq!(strftime("%Y-%m-%d", 0), "1970-01-01");
        assert_eq!(strftime("%F %a", 951_782_400), "2000-02-29 Tue");
        let (y, m, d) = civil_from_days(days_from_civil(2100, 3, 1));
        assert_eq!((y, m, d), (2100, 3, 1));
    }

    /// Qwen 3's and LLaMA 3.1's official templates against transformers' rendering of the same
    /// conversations (tests/data/chat_templates/make_expected.py wrote expected.json).
    #[test]
    fn official_templates_match_transformers() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/chat_templates");
        let read = |name: &str| std::fs::read_to_string(dir.join(name)).unwrap();
        let fixture: serde_json::Value = serde_json::from_str(&read("expected.json")).unwrap();
        for name in ["qwen3", "llama31"] {
            let t = &fixture["templates"][name];
            let tmpl = ChatTemplate::new(read(t["file"].as_str().unwrap()));
            let (bos, eos) = (t["bos_token"].as_str().unwrap(), t["eos_token"].as_str().unwrap());
            for (case, c) in fixture["cases"].as_object().unwrap() {
                let msgs: Vec<Message> = serde_json::from_value(c["messages"].clone()).unwrap();
                let gen = c["add_generation_prompt"].as_bool().unwrap();
                let vars: TemplateVars = c
                    .get("template_kwargs")
                    .map_or_else(TemplateVars::new, |v| serde_json::from_value(v.clone()).unwrap());
                let got = tmpl.render(&msgs, gen, bos, eos, &vars).unwrap();
                let want = fixture["expected"][format!("{name}/{case}")].as_str().unwrap();
                assert_eq!(got, want, "{name}/{case}");
            }
        }
    }

    #[test]
    fn template_vars_parse_from_a_json_object_only() {
        let vars = parse_template_vars(r#"{"enable_thinking": false, "n": [1, 2]}"#).unwrap();
        assert_eq!(vars["enable_thinking"], serde_json::json!(false));
        for (bad, says) in [
            ("enable_thinking=false", "not JSON"),
            ("[1, 2]", "JSON object"),
            ("false", "JSON object"),
            (
                r#"{"add_generation_prompt": false}"#,
                "'add_generation_prompt' is set by probespec",
            ),
            (r#"{"bos_token": ""}"#, "'bos_token' is set by probespec"),
        ] {
            let err = parse_template_vars(bad).unwrap_err().to_string();
            assert!(err.contains(says), "{bad}: {err}");
            assert!(!err.contains('\n'), "one line: {err}");
        }
    }

    #[test]
    fn strftime_now_is_callable() {
        let out = render("{{ strftime_now('%Y') }}", &[], false).unwrap();
        assert!(out.parse::<i32>().unwrap() >= 2024);
    }
}
